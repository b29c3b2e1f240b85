"""One learner rank for tests/learner/test_multirank.py: run as a plain process (1 rank) or under
`python -m torch.distributed.run` (N ranks). Trains the job, then writes what the test checks:
`rank<r>.json` (per-step record ids, rows, losses, rollouts) and `params-rank<r>.pt` (the
trainable parameters) into the output folder.

    python tests/learner/multirank_worker.py JOB.yaml SERVER_ADDRESS OUT_DIR
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

from learner.train.build import build_loop
from rmsft.jobspec import load_job


def main(job_path: str, address: str, out_dir: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    out = Path(out_dir)
    trainer = build_loop(load_job(job_path), [address])
    try:
        summary = trainer.run()
        rank = trainer.ranks.rank
        report = {
            "rank": rank,
            "world_size": trainer.ranks.world_size,
            "has_pool": trainer.pool is not None,
            "has_rollout_client": trainer.rollouts is not None,
            "version": trainer.version,
            "run_id": trainer.state.run_id,  # rank 0's, on every rank
            "rollout_run_ids": sorted({r.weight_run_id for h in trainer.history for r in h.rollouts}),
            "deepspeed": trainer.deepspeed_engine is not None,
            "evaluations": summary.evaluations,  # held-out (step, F1, mAP): rank 0's
            "exported": str(trainer.exported) if trainer.exported else None,
            "steps": [
                {
                    "step": h.step,
                    "loss": h.loss,
                    "parts": h.parts,
                    "record_ids": h.record_ids,
                    "local_record_ids": h.local_record_ids,
                    "local_rows": h.local_rows,
                    "rows": h.rows,
                    "local_tokens": h.local_tokens,
                    "weight_version": h.weight_version,
                    "rollout_ids": [r.request_id for r in h.rollouts],
                    "rollout_versions": sorted({r.weight_version for r in h.rollouts}),
                    "matched": h.figures.stats.matched,
                    "fp": h.figures.stats.false_positives,
                    "fn": h.figures.stats.false_negatives,
                }
                for h in trainer.history
            ],
        }
        torch.save(trainer.checkpointer.gathered_trainable_state(), out / f"params-rank{rank}.pt")  # collective
        (out / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        trainer.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
