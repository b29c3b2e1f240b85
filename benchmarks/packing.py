"""Post-rollout packing: rmsft's packer vs FIFO-greedy vs `binpacking.to_constant_volume`.

Replays one seeded stream of segment lengths shaped like detection rollouts (prompt 1-2k tokens
for the image, response 50-1500 tokens, a few truncated at max_tokens) through every policy, side
by side, and prints mean fill ratio, padding waste (unused row capacity), rows, the longest wait of
any segment (in steps) and selection time per row.

Protocol, identical for the carry policies: each step a rollout batch arrives; rows are emitted
while the buffered tokens reach packing_length; leftovers carry; the stream ends with a flush.
- rmsft: `learner.core.packing.Packer` (oldest segment + exact subset-sum over the buffer).
- fifo-greedy: oldest first, in arrival order, stop at the first segment that does not fit.
- binpacking-carry: `to_constant_volume` over the buffer, emit the bin holding the oldest segment.
- binpacking-fullest: the same, emitting the fullest bin instead (best fill, no starvation guard).
- binpacking-batch: what ms-swift style batch packing does: bins of each step's batch, no carry.

Usage: python benchmarks/packing.py [--steps 300] [--batch 8] [--packing-length 16384] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import binpacking

from learner.core.packing import Packer, select_indices
from learner.core.targets import IGNORE_INDEX, Segment


def detection_lengths(rng: random.Random, n: int) -> list[int]:
    """Prompt ~U(1000, 2000) image+text tokens; response from a heavy-tailed object count."""
    out = []
    for _ in range(n):
        prompt = rng.randint(1000, 2000)
        n_obj = min(60, int(rng.expovariate(1 / 8)) + 1)
        response = 20 + n_obj * rng.randint(22, 30)
        if rng.random() < 0.05:
            response = 1500  # hit max_tokens
        out.append(prompt + max(50, min(1500, response)))
    return out


def segment(n: int, uid: int) -> Segment:
    return Segment(tuple(range(n)), (IGNORE_INDEX,) * n, (), (), 1, 0, {"uid": uid})


def run_carry(stream: list[list[int]], cap: int, choose: Callable[[list[tuple[int, int]]], list[int]]):
    """Generic carry protocol for length-only policies; `choose` returns buffer indices."""
    buf: list[tuple[int, int]] = []
    rows: list[list[tuple[int, int, int]]] = []  # (uid, length, step emitted)
    sel_s = 0.0

    def emit(step: int) -> None:
        nonlocal buf, sel_s
        t0 = time.perf_counter()
        picked = set(choose(buf))
        sel_s += time.perf_counter() - t0
        rows.append([(*buf[i], step) for i in sorted(picked)])
        buf = [x for i, x in enumerate(buf) if i not in picked]

    uid = 0
    arrivals = {}
    for step, lengths in enumerate(stream):
        for n in lengths:
            buf.append((uid, n))
            arrivals[uid] = step
            uid += 1
        while sum(n for _, n in buf) >= cap:
            emit(step)
    while buf:
        emit(len(stream))
    return rows, arrivals, sel_s


def fifo_choose(cap: int):
    def choose(buf):
        idx, total = [], 0
        for i, (_, n) in enumerate(buf):
            if total + n > cap:
                break
            idx.append(i)
            total += n
        return idx

    return choose


def binpacking_choose(cap: int):
    def choose(buf):
        bins = binpacking.to_constant_volume([(i, n) for i, (_, n) in enumerate(buf)], cap, weight_pos=1)
        return [i for i, _ in next(b for b in bins if any(i == 0 for i, _ in b))]

    return choose


def run_rmsft(stream: list[list[int]], cap: int, buffer: int):
    packer = Packer(cap, buffer)
    rows, arrivals, sel_s, uid = [], {}, 0.0, 0
    for step, lengths in enumerate(stream):
        packer.add(segment(n, uid + i) for i, n in enumerate(lengths))
        for i in range(len(lengths)):
            arrivals[uid + i] = step
        uid += len(lengths)
        while packer.pending_tokens >= cap:
            t0 = time.perf_counter()
            select_indices(packer.pending_lengths, cap)  # timed alone: next_row also builds tensors
            sel_s += time.perf_counter() - t0
            row = packer.next_row()
            rows.append([(s.meta["uid"], s.length, step) for s in row.segments])
    while packer.pending:
        t0 = time.perf_counter()
        select_indices(packer.pending_lengths, cap)
        sel_s += time.perf_counter() - t0
        row = packer.next_row()
        rows.append([(s.meta["uid"], s.length, len(stream)) for s in row.segments])
    return rows, arrivals, sel_s


def binpacking_fullest_choose(cap: int):
    def choose(buf):
        bins = binpacking.to_constant_volume([(i, n) for i, (_, n) in enumerate(buf)], cap, weight_pos=1)
        return [i for i, _ in max(bins, key=lambda b: sum(n for _, n in b))]

    return choose


def run_batch_binpacking(stream: list[list[int]], cap: int):
    rows, arrivals, sel_s, uid = [], {}, 0.0, 0
    for step, lengths in enumerate(stream):
        items = [(uid + i, n) for i, n in enumerate(lengths)]
        for u, _ in items:
            arrivals[u] = step
        uid += len(lengths)
        t0 = time.perf_counter()
        bins = binpacking.to_constant_volume(items, cap, weight_pos=1)
        sel_s += time.perf_counter() - t0
        rows += [[(u, n, step) for u, n in b] for b in bins if b]
    return rows, arrivals, sel_s


def summarize(rows, arrivals, sel_s, cap: int, total_segments: int) -> dict[str, float]:
    uids = [u for r in rows for u, _, _ in r]
    assert sorted(uids) == list(range(total_segments)), "a policy lost or duplicated segments"
    fills = [sum(n for _, n, _ in r) / cap for r in rows]
    waits = [step - arrivals[u] for r in rows for u, _, step in r]
    return {
        "fill": statistics.fmean(fills),
        "waste": 1 - sum(n for r in rows for _, n, _ in r) / (len(rows) * cap),
        "rows": len(rows),
        "max_wait": max(waits),
        "sel_ms": 1000 * sel_s / len(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8, help="rollouts per step")
    ap.add_argument("--packing-length", type=int, default=16384)
    ap.add_argument("--packing-buffer", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    stream = [detection_lengths(rng, args.batch) for _ in range(args.steps)]
    flat = [n for b in stream for n in b]
    cap = args.packing_length
    print(
        f"stream: {args.steps} steps x {args.batch} rollouts, segment length mean {statistics.fmean(flat):.0f} "
        f"min {min(flat)} max {max(flat)}; packing_length {cap}",
        flush=True,
    )
    results = {}
    for name, run in [
        ("rmsft", lambda: run_rmsft(stream, cap, args.packing_buffer)),
        ("fifo_greedy", lambda: run_carry(stream, cap, fifo_choose(cap))),
        ("binpacking_carry", lambda: run_carry(stream, cap, binpacking_choose(cap))),
        ("binpacking_fullest", lambda: run_carry(stream, cap, binpacking_fullest_choose(cap))),
        ("binpacking_batch", lambda: run_batch_binpacking(stream, cap)),
    ]:
        results[name] = summarize(*run(), cap, len(flat))
        print(f"  ran {name}", flush=True)

    print(f"\n{'policy':<18}{'mean fill':>10}{'waste':>8}{'rows':>7}{'max wait':>10}{'select ms':>11}")
    for name, r in results.items():
        print(f"{name:<18}{r['fill']:>10.4f}{r['waste']:>8.4f}{r['rows']:>7d}{r['max_wait']:>10d}{r['sel_ms']:>11.3f}")
    best_baseline = max(r["fill"] for n, r in results.items() if n != "rmsft")
    print(f"\nrmsft fill / best baseline fill = {results['rmsft']['fill'] / best_baseline:.4f}")
    print(
        "RESULT "
        + " ".join(f"{n}_fill={r['fill']:.4f}" for n, r in results.items())
        + " "
        + " ".join(f"{n}_waste={r['waste']:.4f}" for n, r in results.items())
        + f" rmsft_max_wait_steps={results['rmsft']['max_wait']}"
        + f" rmsft_select_ms={results['rmsft']['sel_ms']:.3f}"
    )


if __name__ == "__main__":
    main()
