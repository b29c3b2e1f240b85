"""The learner's packed training step at real model shapes: tokens/s, peak memory, the memory plan beside it.

    python benchmarks/gpu_step.py step --shape qwen3-vl-2b --length 8192 --gradient-checkpointing
    python benchmarks/gpu_step.py step --shape 7b --length 4096
    python benchmarks/gpu_step.py packing --shape qwen3-vl-2b --length 8192
    python benchmarks/gpu_step.py offload --shape qwen3-vl-2b
    python benchmarks/gpu_step.py colocate --steps 3
    python benchmarks/gpu_step.py broadcast --length 2048   # MiB; NCCL between two GPUs (gloo with --device cpu)
    python benchmarks/gpu_step.py step --device cpu --shape tiny --length 512   # smoke run, no GPU

Shapes are decoders built from a transformers config with random weights (no download, no folder written):
`qwen3-vl-2b` is Qwen3-VL-2B's text model as a Qwen3 (hidden 2048, 28 layers, vocabulary 151936), `7b` is
Qwen2.5-VL-7B's as a Qwen2 (hidden 3584, 28 layers, vocabulary 152064), `tiny` a 2-layer Qwen2 for the CPU. The
tokenizer is the tiny model's (its ids are a subset of the real vocabulary, its 1000 coordinate tokens give the
coordinate losses something to train); the vision tower is not built (frozen in the job, and its activations
are not what the step spends its memory on).

What trains is what a job trains: configs/job.yaml's `training` (DoRA r 32 on all seven linears, dropout 0.05,
precision bf16) with deepspeed_stage 0, the given packing_length and gradient checkpointing, through
`learner.train.policy.policy_from_model` (the end of `load_policy`) and `learner.train.updater.make_updater`.

Modes, each writing one JSON object (`--json`) and a RESULT line:
- step: one packed row of `--length` tokens in `--segments` segments, the training loop's step (rows moved to the
  device, forward under autocast, CE + coordinate losses, backward, clipping, AdamW); tokens/s (median of
  `--steps` after a warm-up step), the peak of torch.cuda.max_memory_allocated (the process's peak RSS on the
  CPU) and the memory plan's estimate for the same job and shape (rmsft.memory_plan: the learner GPU's peak
  phase less its 1 GiB CUDA-context reserve, which the allocator does not count).
- packing: the same segments of uneven lengths as one packed row and as one right-padded batch (attention
  mask, pads ignored by the loss), the same step; tokens/s counts real tokens only.
- offload: one step, then `learner.train.offload.offloaded(params=True, optimizer=True)`: the bytes it moves,
  the drop of torch.cuda.memory_allocated, the seconds each way (CUDA only).
- colocate: a few steps of a colocated job with the HF engine (spec.rollout.engine: hf; the training model
  decodes itself, so no vLLM) on the tiny model: seconds per step and the rollouts made.
- broadcast: transport nccl's data path (what the learner's rank 0 does over the weight-transfer group) without
  vLLM: `--length` MiB of bf16 broadcast in 64 MiB tensors from one process to another, NCCL between two GPUs
  (SKIP on a one-GPU host: NCCL refuses two ranks on one device), gloo with --device cpu; GB/s.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GiB = 1 << 30
MiB = 1 << 20
SHAPES = ("tiny", "qwen3-vl-2b", "7b")


def decoder_config(shape: str, max_positions: int) -> Any:
    """The transformers config of a decoder-only model at `shape`'s text sizes (rmsft.memory_plan.PRESETS)."""
    from transformers import Qwen2Config, Qwen3Config

    from rmsft.memory_plan import PRESETS

    if shape == "tiny":
        return Qwen2Config(
            vocab_size=2304,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            tie_word_embeddings=True,
            max_position_embeddings=max_positions,
        )
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    )
    if shape == "qwen3-vl-2b":
        text = PRESETS["Qwen3-VL-2B"]["text_config"]
        return Qwen3Config(
            **{k: text[k] for k in keys},
            head_dim=text["head_dim"],
            attention_bias=False,
            tie_word_embeddings=True,
            max_position_embeddings=max_positions,
        )
    if shape == "7b":
        top = PRESETS["Qwen2.5-VL-7B"]
        return Qwen2Config(
            **{k: top[k] for k in keys}, tie_word_embeddings=False, max_position_embeddings=max_positions
        )
    raise SystemExit(f"--shape {shape!r}: expected one of {', '.join(SHAPES)}")


def job_for(length: int, gradient_checkpointing: bool, device: str) -> Any:
    """configs/job.yaml on one learner GPU, no ZeRO, rows of `length` tokens."""
    import yaml

    from rmsft.jobspec import parse_job

    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "job.yaml").read_text()))
    spec = doc["spec"]
    spec["learner"]["gpus"] = 1
    spec["rollout"]["replicas"] = 1
    t = spec["training"]
    t.update(
        deepspeed_stage=0,
        packing_length=length,
        gradient_checkpointing=gradient_checkpointing,
        precision="bf16",
        device=device,
    )
    return parse_job(doc)


def plan_estimate(job: Any, config: Any) -> int:
    """The memory plan's learner-GPU peak for `job` at `config`'s shape, less the CUDA-context reserve."""
    from rmsft.memory_plan import RUNTIME_BYTES, plan_memory, shape_from_config

    shape = shape_from_config(config.to_dict(), "gpu_step config")
    learner = next(d for d in plan_memory(job, shape=shape).plans["server"].devices if d.role.startswith("learner"))
    return learner.peak - RUNTIME_BYTES


def build_policy(config: Any, cfg: Any, device: Any) -> Any:
    """The tiny tokenizer + a random model of `config` built on `device` in the dtype a job loads it in."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner.train.policy import load_dtype, policy_from_model
    from rmsft_dev.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(0)
    if len(tokenizer) > config.vocab_size:
        raise SystemExit(f"the tokenizer has {len(tokenizer)} tokens, more than the shape's {config.vocab_size}")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=load_dtype(cfg, "auto"), attn_implementation=cfg.attn_implementation
        )
    return policy_from_model(model, tokenizer, cfg)


def make_segments(lengths: list[int], coord_ids: list[int], seed: int = 0) -> list[Any]:
    """Segments of random tokens of the given lengths: the second half supervised, every 8th supervised token
    a coordinate token with its bin."""
    import torch

    from learner.core.targets import IGNORE_INDEX, Segment

    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, 1000, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX] * (n // 2) + ids[n // 2 :]
        cpos = list(range(n // 2, n, 8))
        bins = [int(b) for b in torch.randint(0, 1000, (len(cpos),), generator=g)]
        for p, b in zip(cpos, bins, strict=True):
            ids[p] = coord_ids[b]
            labels[p] = coord_ids[b]
        out.append(
            Segment(
                input_ids=tuple(ids),
                labels=tuple(labels),
                coord_positions=tuple(cpos),
                coord_bins=tuple(bins),
                prompt_len=n // 2,
                prefix_len=0,
            )
        )
    return out


def _peak(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _setup(args: argparse.Namespace, gradient_checkpointing: bool) -> tuple[Any, Any, Any, Any, Any]:
    import torch

    from learner.train.ranks import Ranks
    from learner.train.updater import make_updater

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a GPU machine, or pass --device cpu (with --shape tiny)")
    config = decoder_config(args.shape, max(8192, args.length))
    job = job_for(args.length, gradient_checkpointing, args.device)
    cfg = job.spec.training
    policy = build_policy(config, cfg, device)
    step = make_updater(policy.model, Ranks.single(), cfg, device=device, autocast_dtype=policy.autocast_dtype)
    return device, config, job, policy, step


def _timed(fn: Any, steps: int, device: Any) -> tuple[float, int]:
    """Median seconds of `steps` calls after one warm-up call, and the peak memory of the timed calls."""
    fn()
    _reset_peak(device)
    times = [fn() for _ in range(steps)]
    return statistics.median(times), _peak(device)


def run_step(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from learner.core.losses import LossSums, loss_sums
    from learner.core.packing import pack
    from learner.train.config import core_configs

    device, config, job, policy, step = _setup(args, args.gradient_checkpointing)
    cfg = job.spec.training
    core, coord_ids = core_configs(cfg), policy.vocab.coord_token_ids
    seg = args.length // args.segments
    row = pack(make_segments([seg] * args.segments, coord_ids), args.length)
    ce_total, coord_total = int(row.ce_positions.numel()), int(row.coord_positions.numel())
    estimate = plan_estimate(job, config)
    out: dict[str, Any] = {
        "mode": "step",
        "shape": args.shape,
        "device": str(device),
        "length": args.length,
        "grad_ckpt": int(args.gradient_checkpointing),
        "finetune": cfg.finetune,
        "use_dora": cfg.lora.use_dora,
        "params_m": round(sum(p.numel() for p in policy.model.parameters()) / 1e6, 1),
        "plan_estimate_gib": round(estimate / GiB, 3),
    }
    if device.type == "cuda":
        out["gpu_gib"] = round(torch.cuda.get_device_properties(device).total_memory / GiB, 1)

    def one() -> float:
        t0 = time.perf_counter()
        step.begin()
        r = row.to(step.device)
        with step.autocast():
            logits = step.forward(**r.model_inputs()).logits
            s = loss_sums(logits, r, coord_ids, core.weights.sigma)
            loss = LossSums(s.ce_sum, ce_total, s.soft_ce_sum, s.w1_sum, s.gate_sum, coord_total).finish(core.weights)
        del logits
        step.backward(loss.loss)
        step.finish(1, cfg.lr)
        float(loss.loss.detach())  # waits for the device
        return time.perf_counter() - t0

    try:
        med, peak = _timed(one, args.steps, device)
    except torch.OutOfMemoryError as exc:
        return out | {"status": "FAIL", "reason": f"out of memory: {str(exc).splitlines()[0]}"}
    out |= {
        "status": "PASS",
        "step_ms": round(med * 1000, 1),
        "tokens_per_s": round(args.length / med),
        "peak_gib": round(peak / GiB, 3),
    }
    if device.type == "cuda":
        # On the CPU the peak is the process's RSS (Python, libraries): no figure the plan's bytes compare to.
        # Reserved: what the caching allocator held at most (its fragmentation on top of the tensors' peak).
        out["plan_ratio"] = round(peak / estimate, 3)
        out["reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / GiB, 3)
    return out


def _uneven_lengths(total: int, seed: int = 0) -> list[int]:
    """Segment lengths shaped like detection rollouts (a long prompt, a response of varying length), scaled so
    they fill `total` tokens: from total/16 to total/5 each."""
    import random

    rng = random.Random(seed)
    out: list[int] = []
    lo, hi = max(8, total // 16), max(16, total // 5)
    while True:
        n = rng.randint(lo, hi)
        if sum(out) + n > total:
            break
        out.append(n)
    return out


def run_packing(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from learner.core.packing import pack
    from learner.core.targets import IGNORE_INDEX

    device, _config, job, policy, step = _setup(args, args.gradient_checkpointing)
    cfg = job.spec.training
    lengths = _uneven_lengths(args.length)
    segs = make_segments(lengths, policy.vocab.coord_token_ids)
    row = pack(segs, args.length)
    width, pad = max(lengths), int(policy.tokenizer.pad_token_id)
    ids = torch.full((len(segs), width), pad, dtype=torch.long)
    labels = torch.full((len(segs), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(segs), width), dtype=torch.long)
    for i, s in enumerate(segs):
        ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
        labels[i, : len(s.labels)] = torch.tensor(s.labels)
        mask[i, : len(s.input_ids)] = 1

    def loss_of(logits: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        # The same token-level loss for both layouts (shifted CE over supervised positions), so the ratio is
        # the layout's alone; the coordinate losses read the same few positions in either.
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), lab[:, 1:].flatten(), ignore_index=IGNORE_INDEX)

    def packed() -> float:
        t0 = time.perf_counter()
        step.begin()
        r = row.to(step.device)
        with step.autocast():
            loss = loss_of(step.forward(**r.model_inputs()).logits, r.labels)
        step.backward(loss)
        step.finish(1, cfg.lr)
        float(loss.detach())
        return time.perf_counter() - t0

    def padded() -> float:
        t0 = time.perf_counter()
        step.begin()
        i, m, lab = ids.to(step.device), mask.to(step.device), labels.to(step.device)
        with step.autocast():
            loss = loss_of(step.forward(input_ids=i, attention_mask=m, use_cache=False).logits, lab)
        step.backward(loss)
        step.finish(1, cfg.lr)
        float(loss.detach())
        return time.perf_counter() - t0

    real = sum(lengths)
    out: dict[str, Any] = {
        "mode": "packing",
        "shape": args.shape,
        "device": str(device),
        "segments": len(lengths),
        "real_tokens": real,
        "padded_tokens": len(lengths) * width,
        "grad_ckpt": int(args.gradient_checkpointing),
    }
    try:
        t_packed, peak_packed = _timed(packed, args.steps, device)
        t_padded, peak_padded = _timed(padded, args.steps, device)
    except torch.OutOfMemoryError as exc:
        return out | {"status": "FAIL", "reason": f"out of memory: {str(exc).splitlines()[0]}"}
    return out | {
        "status": "PASS",
        "packed_tokens_per_s": round(real / t_packed),
        "padded_tokens_per_s": round(real / t_padded),
        "speedup": round(t_padded / t_packed, 3),
        "packed_peak_gib": round(peak_packed / GiB, 3),
        "padded_peak_gib": round(peak_padded / GiB, 3),
    }


def run_offload(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from learner.train.offload import offloaded

    out: dict[str, Any] = {"mode": "offload", "shape": args.shape, "device": args.device}
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        return out | {
            "status": "SKIP",
            "reason": "needs CUDA: on the CPU nothing is freed (the plan and the "
            "bit-exact return are tested on the CPU in tests/learner/test_colocate_offload.py)",
        }
    device, _config, job, policy, step = _setup(args, True)
    cfg = job.spec.training
    model = policy.model
    row = make_segments([args.length], policy.vocab.coord_token_ids)[0]
    ids = torch.tensor([row.input_ids], device=device)
    step.begin()
    with step.autocast():
        loss = step.forward(input_ids=ids, labels=ids, use_cache=False).loss
    step.backward(loss)
    step.finish(1, cfg.lr)
    torch.cuda.synchronize(device)
    resident = torch.cuda.memory_allocated(device)
    with offloaded(step, model, params=True, optimizer=True) as report:
        during = torch.cuda.memory_allocated(device)
        on_host = {p.device.type for p in model.parameters()} == {"cpu"}
    torch.cuda.synchronize(device)
    back = torch.cuda.memory_allocated(device)
    moved = report.total_bytes
    ok = on_host and report.freed_bytes is not None and report.freed_bytes >= 0.99 * moved and back == resident
    out |= {
        "status": "PASS" if ok else "FAIL",
        "moved_gib": round(moved / GiB, 3),
        "freed_gib": round((report.freed_bytes or 0) / GiB, 3),
        "resident_gib": round(resident / GiB, 3),
        "during_gib": round(during / GiB, 3),
        "back_equal": int(back == resident),
        "offload_s": round(report.offload_s, 3),
        "reload_s": round(report.reload_s, 3),
        "tensors": report.tensors,
    }
    if not ok:
        out["reason"] = (
            "the offload freed less than it moved, or memory did not come back to what it was "
            f"(resident {resident}, during {during}, after {back}, moved {moved}, "
            f"freed {report.freed_bytes})"
        )
    return out


def colocate_job(work: Path, device_type: str, steps: int) -> Any:
    """configs/local-tiny.yaml colocated with the HF engine on `device_type`, tiny model and data under `work`."""
    import yaml

    from rmsft.jobspec import parse_job
    from rmsft_dev.synthetic import write_synthetic_dataset
    from rmsft_dev.tiny_model import build_tiny_model

    model = build_tiny_model(work / "model", seed=0)
    data = write_synthetic_dataset(work / "train.jsonl", n=16, seed=0)
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text()))
    doc["metadata"].pop("annotations")
    spec = doc["spec"]
    spec["model"]["path"] = str(model)
    spec["rollout"].pop("replicas")
    spec["rollout"].update(mode="colocate", engine="hf", enableLora=False, maxModelLen=1024)
    if device_type == "cuda":
        spec["placement"] = {"accelerator": "nvidia", "gpusPerNode": 1}
        spec["learner"]["gpus"] = 1
    t = spec["training"]
    t.update(
        steps=steps,
        prompts_per_step=4,
        packing_length=1024,
        device=device_type,
        precision="bf16" if device_type == "cuda" else "fp32",
    )
    t["data"]["path"] = str(data)
    t["checkpoint"] = {"dir": str(work / "ckpt"), "every": 0, "keep": 1}
    t["export"] = {"enabled": False}
    t["rollout"].update(max_tokens=32, seed=3)
    return parse_job(doc)


def run_colocate(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from learner.train.build import build_loop

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: pass --device cpu")
    job = colocate_job(Path(tempfile.mkdtemp(prefix="rmsft-gpu-colocate-")), device.type, args.steps)
    out: dict[str, Any] = {"mode": "colocate", "engine": "hf", "device": str(device), "steps": args.steps}
    trainer = build_loop(job, [])
    try:
        model_device = next(trainer.policy.model.parameters()).device
        t0 = time.perf_counter()
        trainer.run()
        wall = time.perf_counter() - t0
        history = list(trainer.history)
    finally:
        trainer.close()
    completions = sum(len(getattr(h, "rollouts", ()) or ()) for h in history)
    ok = len(history) == args.steps and model_device.type == device.type
    out |= {
        "status": "PASS" if ok else "FAIL",
        "steps_done": len(history),
        "s_per_step": round(wall / args.steps, 3),
        "model_device": str(model_device),
        "rollouts": completions,
        "final_loss": round(float(history[-1].loss), 4) if history else None,
    }
    if device.type == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / GiB, 3)
    if not ok:
        out["reason"] = f"{len(history)} of {args.steps} steps ran, model on {model_device}"
    return out


def _broadcast_rank(rank: int, port: int, backend: str, total_mib: int, piece_mib: int, out: str) -> None:
    """One rank of `run_broadcast` (rank 0 sends, as the learner does over transport nccl's group)."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    n = piece_mib * MiB // 2
    pieces = max(1, total_mib // piece_mib)
    sent = torch.arange(n, device=device, dtype=torch.int32).to(torch.bfloat16)
    buf = sent.clone() if rank == 0 else torch.empty(n, device=device, dtype=torch.bfloat16)
    dist.broadcast(buf, 0)  # warm-up: the communicator's first use sets up its connections
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(pieces):
        if rank != 0:
            buf.zero_()
        dist.broadcast(buf, 0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    if rank == 1:
        Path(out).write_text(
            json.dumps({"wall_s": wall, "equal": bool(torch.equal(buf, sent)), "bytes": pieces * n * 2})
        )
    dist.destroy_process_group()


def run_broadcast(args: argparse.Namespace) -> dict[str, Any]:
    """Transport nccl's data path without vLLM: rank 0 broadcasts `--length` MiB of bf16 in 64 MiB tensors to a
    second process, NCCL between two GPUs (a GPU per rank: NCCL refuses two ranks on one device), gloo on the CPU
    form. GB/s, and whether the last tensor arrived equal."""
    import socket

    import torch
    import torch.multiprocessing as mp

    cuda = torch.device(args.device).type == "cuda"
    out: dict[str, Any] = {"mode": "broadcast", "device": args.device, "backend": "nccl" if cuda else "gloo"}
    if cuda and torch.cuda.device_count() < 2:
        return out | {
            "status": "SKIP",
            "reason": f"NCCL needs a GPU per rank: this host has "
            f"{torch.cuda.device_count()} (a learner and a server on two GPUs give the figure)",
        }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    total = max(64, args.length)
    result = Path(tempfile.mkdtemp(prefix="rmsft-broadcast-")) / "rank1.json"
    mp.spawn(_broadcast_rank, args=(port, out["backend"], total, 64, str(result)), nprocs=2, join=True)
    got = json.loads(result.read_text())
    ok = got["equal"]
    out |= {
        "status": "PASS" if ok else "FAIL",
        "mib": got["bytes"] // MiB,
        "wall_s": round(got["wall_s"], 3),
        "gbps": round(got["bytes"] / got["wall_s"] / 1e9, 3),
    }
    if not ok:
        out["reason"] = "the received tensor differs from the sent one"
    return out


RUNNERS = {
    "step": run_step,
    "packing": run_packing,
    "offload": run_offload,
    "colocate": run_colocate,
    "broadcast": run_broadcast,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=sorted(RUNNERS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-vl-2b")
    ap.add_argument("--length", type=int, default=4096, help="tokens in the packed row (training.packing_length)")
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the result object here too")
    args = ap.parse_args(argv)
    result = RUNNERS[args.mode](args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items() if k != "reason"))
    if result.get("reason"):
        print(f"reason: {result['reason']}")


if __name__ == "__main__":
    main()
