"""Does a run's training forward equal the same forward done again? A diagnostic for a known CPU fault.

    python scripts/first_forward_check.py JOB.yaml [--runs 5] [--steps 3]

Runs `rmsft local JOB` `--runs` times, each in a fresh process, with `training.steps` cut to `--steps`. At every
step it repeats the policy's forward on the step's first packed row (no grad, right after the step's own forward,
same weights and inputs) and prints the largest difference between the two logits, for the row's first and second
half. On a 2-core machine, `configs/job-kind-cpu.yaml` (paths moved to a local folder, one server) shows the
fault in about half the runs: step 1's forward differs from itself by about 1e-3 in the second half of the row
only (the second OpenMP thread's share), later steps by 0 (docs/development.md, "The CPU learner's first
forward"). Anything that slows the forward (hooks that copy every module's output) hides it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

CHILD = r"""
import json, os, sys
import torch
from learner.train.objectives import rollout_matching as rm

original, seen = rm.loss_sums, []

def loss_sums(logits, row, coord_ids, sigma=2.0, weighted=False):
    if len(seen) < int(os.environ["CHECK_STEPS"]):
        model = rm_model()
        with torch.no_grad():
            again = model(**row.model_inputs()).logits
        d = (again - logits.detach()).abs().reshape(-1, logits.shape[-1]).amax(-1)
        half = d.numel() // 2
        seen.append({"first_half": d[:half].max().item(), "second_half": d[half:].max().item()})
        # Printed at once: `rmsft local` may leave through os._exit, past any `finally`.
        print("CHECK " + json.dumps(seen[-1]), file=sys.stderr, flush=True)
    return original(logits, row, coord_ids, sigma, weighted)

def rm_model():
    import gc
    from torch import nn
    found = [o for o in gc.get_objects() if isinstance(o, nn.Module) and hasattr(o, "generation_config")
             and o.__class__.__name__.startswith("Peft")] or \
            [o for o in gc.get_objects() if isinstance(o, nn.Module) and hasattr(o, "generation_config")]
    return found[0]

rm.loss_sums = loss_sums
from rmsft_cli.app import main
sys.argv = ["rmsft", "local", sys.argv[1], "--work-dir", sys.argv[2]]
main()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    doc = yaml.safe_load(args.job.read_text())
    faulty = 0
    with tempfile.TemporaryDirectory(prefix="rmsft-ffc-") as tmp:
        # The cluster job's baked paths (/opt/rmsft/tiny-model) moved here: `rmsft local` builds what they name.
        text = yaml.safe_dump(doc).replace("/opt/rmsft/tiny-model", f"{tmp}/model")
        doc = yaml.safe_load(text)
        spec = doc["spec"]
        spec["training"]["steps"] = args.steps
        # The check compares the row's whole logits: the full-logits path (the chunked loss hands the loss a RowHead).
        spec["training"].setdefault("loss", {})["logits"] = "full"
        spec["training"]["checkpoint"] = {"dir": f"{tmp}/checkpoints", "every": 0}
        spec["rollout"]["replicas"] = 1
        job = Path(tmp) / "job.yaml"
        job.write_text(yaml.safe_dump(doc))
        for i in range(args.runs):
            env = {**os.environ, "CHECK_STEPS": str(args.steps)}
            p = subprocess.run(
                [sys.executable, "-c", CHILD, str(job), f"{tmp}/run{i}"],
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            steps = [json.loads(ln[len("CHECK ") :]) for ln in p.stderr.splitlines() if ln.startswith("CHECK ")]
            if p.returncode or len(steps) != args.steps:
                print(
                    f"run {i}: rmsft local failed (exit {p.returncode}, {len(steps)} of {args.steps} steps "
                    f"checked):\n{p.stderr[-2000:]}",
                    file=sys.stderr,
                )
                return 1
            bad = any(s["first_half"] or s["second_half"] for s in steps)
            faulty += bad
            cells = "  ".join(
                f"step {k + 1}: {s['first_half']:.1e}/{s['second_half']:.1e}" for k, s in enumerate(steps)
            )
            print(f"run {i}: {'DIFFERS' if bad else 'equal  '}  {cells}", flush=True)
    print(f"RESULT runs={args.runs} differing={faulty}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
