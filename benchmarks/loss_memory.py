"""Peak memory of the loss of one packed row: the whole row's logits (`spec.training.loss.logits: full`) against
logits only at target positions, a chunk at a time (`chunked`, learner/core/head.py).

    python benchmarks/loss_memory.py [--tokens 8192] [--vocab 152936] [--hidden 512] [--chunk 1024]
                                     [--modes chunked,full] [--dtype float32]

One packed row of `--tokens` tokens made of segments shaped like dense detection answers: each a prompt of image
and text tokens (no targets) and an answer of which 900 tokens are targets, 80 of them coordinates (20 boxes); at
8192 tokens, 3 segments (2,700 targets, 240 coordinates) and padding-free filler prompt. The vocabulary is
Qwen3-VL's 151,936 plus the 1,000 coordinate tokens. The hidden states [L, hidden] and an output head
[vocab, hidden] are random; "the loss" is the head and the first-generation loss (CE + soft CE, W1, gate),
forward and backward, exactly as the learner runs it for each setting. Each mode runs in a fresh process:

- peak tensors: the most bytes of tensor storage created by the head, the loss and its backward and alive at
  once, counted by a torch dispatch mode (tests/learner/alloc_tracker.py); on a GPU this is what lands on the
  device (the head's weight gradient, vocab x hidden x 4 bytes, is in both).
- peak RSS: the process's high-water mark (VmHWM, reset right before the loss) minus its RSS then.

The width (`--hidden`) changes only the head's weight, its gradient and the hidden states' gradient, not the
logits; 512 keeps the CPU time short. The last line is `RESULT key=value ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests/learner"))

MIB = 1 << 20
ANSWER_TARGETS = 900  # target tokens per segment (a dense answer: 20 boxes with their labels and structure)
ANSWER_COORDS = 80  # of them coordinate positions (4 per box)
SEGMENT_TOKENS = 2730  # per segment, prompt (image + text) included


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1)) * 1024


def _settle() -> None:
    gc.collect()
    with contextlib.suppress(OSError):  # free heap back to the OS, so the baseline is what is live
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _row(tokens: int, vocab: int, seed: int = 0):
    import torch

    from learner.core.packing import pack
    from learner.core.targets import IGNORE_INDEX, Segment

    g = torch.Generator().manual_seed(seed)
    segs, left = [], tokens
    while left >= SEGMENT_TOKENS:
        n = SEGMENT_TOKENS if left - SEGMENT_TOKENS >= SEGMENT_TOKENS else left  # the last one takes the rest
        prompt = n - ANSWER_TARGETS
        ids = torch.randint(0, vocab - 1000, (n,), generator=g).tolist()
        coord_pos = sorted(torch.randperm(ANSWER_TARGETS, generator=g)[:ANSWER_COORDS].add(prompt).tolist())
        bins = torch.randint(0, 1000, (ANSWER_COORDS,), generator=g).tolist()
        for p, b in zip(coord_pos, bins, strict=True):
            ids[p] = vocab - 1000 + b
        coords = set(coord_pos)
        labels = [IGNORE_INDEX if i < prompt or i in coords else t for i, t in enumerate(ids)]
        segs.append(Segment(tuple(ids), tuple(labels), tuple(coord_pos), tuple(bins), prompt, prompt))
        left -= n
    row = pack(segs, packing_length=tokens)
    if row.length != tokens:
        raise SystemExit(f"the row has {row.length} tokens, not {tokens} (use a multiple of {SEGMENT_TOKENS} or more)")
    return row


def child(args: argparse.Namespace) -> dict:
    import torch
    from alloc_tracker import AllocationTracker

    from learner.core.head import RowHead
    from learner.core.losses import LossWeights, compute_loss

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    row = _row(args.tokens, args.vocab)
    coord_ids = torch.arange(args.vocab - 1000, args.vocab)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, dtype=dtype)
    torch.nn.init.normal_(head.weight, std=0.02)
    hidden = torch.randn(1, args.tokens, args.hidden, dtype=dtype).requires_grad_(True)
    _settle()
    base_rss = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    tracker = AllocationTracker()
    t0 = time.perf_counter()
    with tracker:
        # What the learner's forward hands the loss: the model's logits of the whole row, or its hidden states and
        # head (learner.core.head.row_outputs).
        logits = head(hidden) if args.mode == "full" else RowHead(hidden, head, args.chunk)
        out = compute_loss(logits, row, coord_ids, LossWeights())
        out.loss.backward()
        del logits
    seconds = time.perf_counter() - t0
    peak_rss = _status("VmHWM") - base_rss
    return {
        "mode": args.mode,
        "loss": float(out.loss),
        "peak_tensor_bytes": tracker.peak,
        "peak_rss_bytes": peak_rss,
        "seconds": seconds,
        "targets": int(row.ce_positions.numel() + row.coord_positions.numel()),
        "coords": int(row.coord_positions.numel()),
        "grad_norm": float(hidden.grad.float().norm()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151936 + 1000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--modes", default="chunked,full")
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # a child process: one mode
    args = ap.parse_args()
    if args.mode:
        print("RESULT_JSON " + json.dumps(child(args)), flush=True)
        return
    rows = {}
    for mode in args.modes.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--mode",
            mode,
            *(f"--{k}={getattr(args, k)}" for k in ("tokens", "vocab", "hidden", "chunk", "dtype")),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT_JSON ")), None)
        if res.returncode or line is None:
            raise SystemExit(f"mode {mode} failed (exit {res.returncode}): {res.stderr[-2000:]}")
        rows[mode] = r = json.loads(line.removeprefix("RESULT_JSON "))
        print(
            f"{mode:8s} loss {r['loss']:.6f}  peak tensors {r['peak_tensor_bytes'] / MIB:9.1f} MiB  peak RSS "
            f"{r['peak_rss_bytes'] / MIB:9.1f} MiB  {r['seconds']:.1f} s  ({r['targets']} targets, "
            f"{r['coords']} coordinates, |grad hidden| {r['grad_norm']:.6g})",
            flush=True,
        )
    fields = [
        f"tokens={args.tokens}",
        f"vocab={args.vocab}",
        f"hidden={args.hidden}",
        f"chunk={args.chunk}",
        f"dtype={args.dtype}",
    ]
    for mode, r in rows.items():
        fields += [
            f"{mode}_peak_tensor_mib={r['peak_tensor_bytes'] / MIB:.1f}",
            f"{mode}_peak_rss_mib={r['peak_rss_bytes'] / MIB:.1f}",
            f"{mode}_s={r['seconds']:.1f}",
        ]
    if {"full", "chunked"} <= rows.keys():
        f, c = rows["full"], rows["chunked"]
        fields += [
            f"ratio_tensors={f['peak_tensor_bytes'] / c['peak_tensor_bytes']:.1f}",
            f"loss_diff={abs(f['loss'] - c['loss']):.2e}",
        ]
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
