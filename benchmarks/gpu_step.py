"""The learner's packed training step on a GPU: tokens/s and peak memory for a given model size.

    python benchmarks/gpu_step.py --hidden 2048 --layers 24 --length 8192 --precision bf16
    python benchmarks/gpu_step.py --device cpu --hidden 256 --layers 2 --length 1024 --steps 2   # smoke run

What runs is the Trainer's own step (`learner.train.step.make_step` + `Trainer.device_step`'s body:
rows moved to the device, forward under the precision's autocast, the coordinate + CE losses,
backward, clipping, AdamW) on one packed row of `--length` tokens made of `--segments` segments,
a random Qwen2 of the given size (tokenizer with the 1000 coordinate tokens), LoRA or full.
Prints tokens/s (median of `--steps` after one warm-up step) and the peak memory the step allocated
(`torch.cuda.max_memory_allocated`; on the CPU the process's peak RSS), and a RESULT line.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--length", type=int, default=4096, help="tokens in the packed row")
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--finetune", choices=["lora", "full"], default="lora")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a GPU machine, or pass --device cpu for a smoke run")

    from learner.core.packing import pack
    from learner.core.targets import IGNORE_INDEX, Segment
    from learner.train.config import core_configs
    from learner.train.policy import load_policy
    from learner.train.ranks import Ranks
    from learner.train.step import make_step
    from rmsft.dev.tiny_model import build_tiny_model
    from rmsft.jobspec import TrainingConfig

    model_dir = build_tiny_model(Path(tempfile.gettempdir()) / f"rmsft-gpu-step-h{args.hidden}-l{args.layers}",
                                 seed=0, hidden_size=args.hidden, num_layers=args.layers,
                                 max_position_embeddings=max(8192, args.length))
    cfg = TrainingConfig.model_validate({
        "data": {"path": "unused.jsonl"}, "finetune": args.finetune, "precision": args.precision,
        "gradient_checkpointing": args.gradient_checkpointing, "lr": 1e-4,
    })
    policy = load_policy(model_dir, cfg)
    model = policy.model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    step = make_step(model, Ranks(None), cfg, device=device, autocast_dtype=policy.autocast_dtype)
    core = core_configs(cfg)
    coord_ids = policy.vocab.coord_token_ids

    # One packed row: segments of random tokens, the second half of each supervised, every 8th
    # supervised token a coordinate token with its bin.
    g = torch.Generator().manual_seed(0)
    seg_len = args.length // args.segments
    vocab = int(model.get_input_embeddings().weight.shape[0])
    segments = []
    for _ in range(args.segments):
        ids = torch.randint(0, vocab, (seg_len,), generator=g).tolist()
        labels = [IGNORE_INDEX] * (seg_len // 2) + ids[seg_len // 2:]
        cpos = list(range(seg_len // 2, seg_len, 8))
        bins = [int(b) for b in torch.randint(0, 1000, (len(cpos),), generator=g)]
        for p, b in zip(cpos, bins, strict=True):
            ids[p] = coord_ids[b]
            labels[p] = coord_ids[b]
        segments.append(Segment(input_ids=tuple(ids), labels=tuple(labels), coord_positions=tuple(cpos),
                                coord_bins=tuple(bins), prompt_len=seg_len // 2, prefix_len=0))
    row = pack(segments, args.length)
    ce_total = int(row.ce_positions.numel())
    coord_total = int(row.coord_positions.numel())

    from learner.core.losses import LossSums, loss_sums

    def one_step() -> float:
        t0 = time.perf_counter()
        step.begin()
        r = row.to(step.device)
        with step.autocast():
            logits = step.forward(**r.model_inputs()).logits
            s = loss_sums(logits, r, coord_ids, core.weights.sigma)
            out = LossSums(s.ce_sum, ce_total, s.soft_ce_sum, s.w1_sum, s.gate_sum, coord_total).finish(core.weights)
        step.backward(out.loss)
        step.finish(1, cfg.lr)
        float(out.loss)  # wait for the device
        return time.perf_counter() - t0

    one_step()  # warm-up (kernels, allocator)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [one_step() for _ in range(args.steps)]
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    med = statistics.median(times)
    tok_s = args.length / med
    print(f"{args.device}: {n_params / 1e6:.1f}M parameters ({args.finetune}, {args.precision}"
          f"{', grad ckpt' if args.gradient_checkpointing else ''}), row of {args.length} tokens in "
          f"{args.segments} segments: {med * 1000:.1f} ms/step, {tok_s:.0f} tokens/s, peak {peak / 2**30:.2f} GiB")
    print(f"RESULT device={args.device} params_m={n_params / 1e6:.1f} length={args.length} "
          f"precision={args.precision} finetune={args.finetune} grad_ckpt={int(args.gradient_checkpointing)} "
          f"step_ms={med * 1000:.1f} tokens_per_s={tok_s:.0f} peak_gib={peak / 2**30:.3f}")


if __name__ == "__main__":
    main()
