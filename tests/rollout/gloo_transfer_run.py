"""Runs vLLM's weight-transfer API with rmsft's gloo engine in its own process (vLLM spawns its engine and worker
processes, which need a `__main__` guard that pytest's process does not give). Usage: MODEL_DIR OUT_JSON.

An AsyncLLM as `rmsft serve` builds it (rollout_engine.vllm_engine.engine_args, plus weight_transfer_config
{"backend": "rmsft_gloo"}); this process is rank 0 of the gloo group (the learner's part, GlooSender). Greedy answers
to two prompts: before any update, after the model's weights perturbed were sent, after the original weights were
sent back over the same group; HF's greedy answers with the perturbed weights. Writes them as JSON."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
MAX_TOKENS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run(model_dir: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from rollout_engine.config import ServeConfig
    from rollout_engine.vllm_engine import engine_args
    from rollout_engine.weight_transfer_gloo import BACKEND, GlooSender

    kw = engine_args(ServeConfig(model=model_dir, dtype="float32", max_model_len=256, kv_cache_bytes=64 << 20),
                     on_gpu=False)
    kw["weight_transfer_config"] = {"backend": BACKEND}
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)

    async def answers(tag: str) -> list[list[int]]:
        out = []
        for i, ids in enumerate(PROMPTS):
            last = None
            async for o in llm.generate({"prompt_token_ids": ids}, params, request_id=f"{tag}-{i}"):
                last = o
            out.append(list(last.outputs[0].token_ids))
        return out

    def hf_answers(model) -> list[list[int]]:
        return [model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):].tolist()
                for ids in PROMPTS]

    sender = GlooSender("127.0.0.1", _free_port(), world_size=2)

    async def send(tensors: list) -> float:
        t0 = time.perf_counter()
        await llm.pause_generation(mode="wait")
        await llm.start_weight_update()
        update = asyncio.ensure_future(llm.update_weights(WeightTransferUpdateRequest(
            update_info=GlooSender.describe(tensors))))
        await asyncio.to_thread(sender.send, tensors)
        await update
        await llm.finish_weight_update()
        await llm.resume_generation()
        return time.perf_counter() - t0

    try:
        before = await answers("before")
        init = asyncio.ensure_future(llm.init_weight_transfer_engine(WeightTransferInitRequest(
            init_info=sender.init_info())))
        await asyncio.to_thread(sender.join)  # both sides block in the rendezvous: the engine's call runs meanwhile
        await init
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        original = {k: v.clone() for k, v in hf.state_dict().items()}
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for p in hf.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        # state_dict, not parameters: a tied head is a checkpoint name of its own for vLLM's loader
        perturbed_s = await send(list(hf.state_dict().items()))
        perturbed = await answers("perturbed")
        reference = hf_answers(hf)
        restored_s = await send(list(original.items()))
        restored = await answers("restored")
    finally:
        llm.shutdown()
    return {"before": before, "perturbed": perturbed, "hf_perturbed": reference, "restored": restored,
            "send_s": [perturbed_s, restored_s]}


if __name__ == "__main__":
    result = asyncio.run(run(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(result))
