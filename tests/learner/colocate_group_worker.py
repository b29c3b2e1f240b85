"""One rank of a TP group for tests/learner/test_colocate.py: under
`python -m torch.distributed.run --nproc-per-node 2`, each rank holds a TP-1 HF engine standing in for its shard of
one engine; the group gathers both ranks' requests, every rank generates for the whole group, and keeps its own
slice. Writes rank<r>.json: per call, this rank's completions (request id, sample index, token ids).

    python -m torch.distributed.run --nproc-per-node 2 tests/learner/colocate_group_worker.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from learner.rollouts.colocate.groups import TpGroup
from learner.rollouts.colocate.rollouts import ColocatedRollouts
from learner.rollouts.requests import RolloutRequest
from rollout_engine.hf_engine import HfEngine

# Per call: which prompts (by index) each rank brings. Uneven, and a rank that brings none.
CALLS = [{0: [0, 1, 2], 1: [3, 4]}, {0: [5, 6], 1: []}, {0: [], 1: [7]}]
PROMPTS = [[5 + i, 9, 13 + 2 * i, 21, 40 + i] for i in range(8)]
SAMPLING = {"max_tokens": 12, "temperature": 1.0, "n": 2}


def requests(indices: list[int]) -> list[RolloutRequest]:
    return [RolloutRequest(token_ids=PROMPTS[i], seed=100 + i, request_id=f"p{i}") for i in indices]


def source(model_dir: str, group: TpGroup, rank: int) -> ColocatedRollouts:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = HfEngine.around(model, AutoTokenizer.from_pretrained(model_dir), max_model_len=512)
    src = ColocatedRollouts(engine, model, run_id="run-a", group=group, rank=rank)
    src.sync(1)
    return src


def main(model_dir: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    src = source(model_dir, TpGroup(world, rank, world), rank)
    calls = []
    for call in CALLS:
        outs = src.generate(requests(call[rank]), SAMPLING, weight_version=1)
        calls.append([(o.request_id, o.sample_index, list(o.token_ids), o.weight_version) for o in outs])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(calls))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
