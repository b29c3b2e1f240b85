"""Weight sync, every transport, 1 to N servers, in one run: what a FULL update costs end to end.

    python benchmarks/weight_sync.py [--gib 1.0] [--servers 1,2,4] [--backend hf] [--rounds 2]
                                     [--transports grpc,shm,nccl,nccl_bucketed] [--bucket-mb 512]

Builds a random Qwen2 checkpoint of >= --gib GiB (float32, tokenizer of the tiny model), starts
max(--servers) `rmsft serve` processes on it (each with its own staging dir in /dev/shm, all with
one shared-weights dir), loads the same checkpoint as the learner's model in this process, and
times `WeightSyncClient.sync` (the learner's own client: FULL export, encode or write, send,
every server's verify and apply) for each transport and pool size, rounds in alternating order:

- grpc: one stream from the learner to the first server, relayed server to server;
- shm: the update written once into the shared dir, read by every server;
- nccl: the update broadcast once from the learner to every server over a weight-transfer group, here with its
  CPU backend (gloo: `rollout_engine.weight_transfer_gloo`; on GPUs the same control path drives vLLM's NCCL engine).
  The group is built before the timed sync (untimed, as a run builds it once); its build time is reported apart.
  "nccl" sends one broadcast per tensor; "nccl_bucketed" is the same group with spec.sync.bucketMegabytes
  (--bucket-mb): the tensors packed into buckets, one broadcast per bucket (issue 60 item 4). Both in one run give
  `bucketed_vs_per_tensor_N`. Here gloo stands in for NCCL (no GPU on this machine): the ratio says what packing
  saves on gloo's per-collective cost, not what it saves on NCCL.

Per case: wall seconds and GB/s (update bytes / wall; and without the engine's apply, the copy of
the verified tensors into the model, as the servers the learner called report it), learner CPU-seconds (this process),
server CPU-seconds (all servers of the case, engine processes included), and memory: the peak
growth of each server's own staging dir during the sync (tensor bytes it stages beyond what it
held before: the rollback copy of the previous update stays until the new one is applied), the
peak of the shared dir, and the peak growth of /dev/shm as a whole, sampled every 5 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learner.rollouts.pool import ServerPool  # noqa: E402
from learner.sync.client import WeightSyncClient  # noqa: E402
from rmsft.weight_wire import DEFAULT_FRAME_BYTES, SHARED_DIR_ENV  # noqa: E402
from rollout_svc.launcher import RolloutServer  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20


def build_model(out: Path, gib: float) -> None:
    """Random Qwen2 with enough layers to reach `gib` GiB of float32 weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rmsft_dev.tiny_model import build_tokenizer

    marker = out / "bench.json"
    if marker.exists() and json.loads(marker.read_text()).get("gib") == gib:
        return
    tok = build_tokenizer(0)
    hidden, inter = 1024, 4096
    per_layer = 4 * (hidden * hidden * 2 + hidden * 64 * 2 + 3 * hidden * inter)
    layers = max(1, int(gib * GIB / per_layer) + 1)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    print(f"building a {layers}-layer random Qwen2 in {out} ...", flush=True)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    marker.write_text(json.dumps({"gib": gib}))


def _dir_bytes(path: Path) -> int:
    """Bytes the files directly in `path` occupy (allocated blocks: fallocate counts at once)."""
    total = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(path) as it:
        for e in it:
            with contextlib.suppress(FileNotFoundError):  # removed while we looked
                total += e.stat(follow_symlinks=False).st_blocks * 512
    return total


class Sampler(threading.Thread):
    """Peak sizes of the servers' staging dirs, the shared dir and /dev/shm during one sync."""

    def __init__(self, staging: list[Path], shared: Path) -> None:
        super().__init__(daemon=True)
        self.staging, self.shared = staging, shared
        self.stop_evt = threading.Event()
        self.base = self._sample()
        self.peak = list(self.base)

    def _sample(self) -> list[int]:
        return [_dir_bytes(p) for p in self.staging] + [_dir_bytes(self.shared), shutil.disk_usage("/dev/shm").used]

    def run(self) -> None:
        t0 = time.thread_time()
        while not self.stop_evt.is_set():
            self.peak = [max(a, b) for a, b in zip(self.peak, self._sample(), strict=True)]
            time.sleep(0.005)
        self.cpu = time.thread_time() - t0  # runs in the learner's process: not the learner's work

    def finish(self) -> dict[str, int]:
        self.stop_evt.set()
        self.join()
        self.peak = [max(a, b) for a, b in zip(self.peak, self._sample(), strict=True)]
        n = len(self.staging)
        grow = [p - b for p, b in zip(self.peak, self.base, strict=True)]
        return {
            "stage_per_server": max(grow[:n]),
            "held_before": max(self.base[:n]),
            "shared": self.peak[n],
            "shm": grow[n + 1],
        }


def _tree_cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        for q in [p, *p.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = q.cpu_times()
                total += t.user + t.system
    return total


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size (float32)")
    ap.add_argument("--servers", default="1,2,4", help="pool sizes to compare")
    ap.add_argument(
        "--backend",
        default="hf",
        choices=["hf", "vllm"],
        help="rollout engine; hf by default: 4 vLLM-CPU engines of a 1 GiB model and their KV caches "
        "do not fit this machine beside the learner",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--transports",
        default="grpc,shm,nccl,nccl_bucketed",
        help="nccl: one broadcast per tensor; nccl_bucketed: buckets of --bucket-mb (the group's packing)",
    )
    ap.add_argument("--bucket-mb", type=int, default=512, help="nccl_bucketed's bucket size (MiB)")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "rmsft-bench-sync-model"))
    args = ap.parse_args()
    sizes = [int(x) for x in args.servers.split(",")]
    transports = args.transports.split(",")
    model_dir = Path(args.model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    build_model(model_dir, args.gib)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    work = Path(tempfile.mkdtemp(prefix="rmsft-bench-sync-", dir="/dev/shm"))
    shared = work / "shared"
    shared.mkdir()
    staging = [work / f"stage-{i}" for i in range(max(sizes))]
    for p in staging:
        p.mkdir()
    print(f"starting {max(sizes)} rmsft serve ({args.backend}) ...", flush=True)
    t0 = time.perf_counter()
    servers: list[RolloutServer] = []
    version = 0
    try:
        for i, stage in enumerate(staging):
            servers.append(
                RolloutServer.start(
                    model_dir,
                    backend=args.backend,
                    dtype="float32",
                    max_model_len=512,
                    kv_cache_bytes=64 * MIB,
                    staging_dir=str(stage),
                    env={SHARED_DIR_ENV: str(shared)},
                    timeout=900,
                    log_path=work / f"serve-{i}.log",
                    weight_transfer="rmsft_gloo",
                )
            )
        print(f"servers ready in {time.perf_counter() - t0:.0f}s", flush=True)
        procs = [psutil.Process(s.proc.pid) for s in servers]
        with ServerPool([s.address for s in servers]) as pool:  # untimed: first-time costs on both ends
            for transport in transports:
                version += 1
                _client(pool, model, transport, shared, args.bucket_mb).sync(version)
        builds: list[float] = []  # seconds per weight-transfer group built (transport nccl)
        collectives: dict[str, int] = {}  # broadcasts per update, per nccl variant
        results: dict[tuple[str, int], list[dict[str, float]]] = {}
        cases = [(t, n) for t in transports for n in sizes]
        for rnd in range(args.rounds):
            for transport, n in cases if rnd % 2 == 0 else list(reversed(cases)):
                version += 1
                with ServerPool([s.address for s in servers[:n]]) as pool:
                    client = _client(pool, model, transport, shared, args.bucket_mb)
                    if client.group is not None:  # a run builds its group once: not part of a sync's cost
                        b0 = time.perf_counter()
                        client.group.build(pool.servers, {s.address: pool.status(s) for s in pool.servers})
                        builds.append(time.perf_counter() - b0)
                    sampler = Sampler(staging[:n], shared)
                    sampler.start()
                    c0, s0, w0 = _self_cpu(), _tree_cpu(procs[:n]), time.perf_counter()
                    report = client.sync(version)
                    wall = time.perf_counter() - w0
                    c1, s1 = _self_cpu(), _tree_cpu(procs[:n])
                    mem = sampler.finish()
                    c1 -= sampler.cpu
                assert len(report.acked) == n, report
                if client.group is not None:
                    assert client.group.updates == 1, "the timed nccl sync fell back to gRPC (see the log)"
                    collectives.setdefault(transport, client.group.sender.collectives)
                    client.close()
                # The engine's apply (copying the verified tensors into the model) as the servers the
                # learner called report it; the rest of the wall time is the transport's.
                apply_s = max(r.apply_seconds for r in report.acked.values())
                row = {
                    "wall": wall,
                    "gbps": report.tensor_bytes / wall / 1e9,
                    "learner_cpu": c1 - c0,
                    "server_cpu": s1 - s0,
                    "bytes": report.tensor_bytes,
                    "apply": apply_s,
                    "transfer_gbps": report.tensor_bytes / (wall - apply_s) / 1e9,
                    **mem,
                }
                results.setdefault((transport, n), []).append(row)
                print(
                    f"round {rnd + 1} {transport:4s} x{n}: {wall:6.2f}s {row['gbps']:.3f} GB/s, learner "
                    f"{row['learner_cpu']:.2f} CPU-s, servers {row['server_cpu']:.2f} CPU-s, staging/server "
                    f"+{mem['stage_per_server'] / MIB:.0f} MiB (held {mem['held_before'] / MIB:.0f}), shared "
                    f"{mem['shared'] / MIB:.0f} MiB, /dev/shm +{mem['shm'] / MIB:.0f} MiB",
                    flush=True,
                )
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(work, ignore_errors=True)

    med = {k: {f: statistics.median(r[f] for r in rows) for f in rows[0]} for k, rows in results.items()}
    update = next(iter(med.values()))["bytes"]
    print(f"\nmedian of {args.rounds} rounds; update {update / GIB:.2f} GiB, frame {DEFAULT_FRAME_BYTES / MIB:g} MiB")
    print(
        "| transport | servers | wall s | GB/s | apply s | GB/s without apply | learner CPU-s | server CPU-s |"
        " staging/server (peak growth) | shared dir peak | /dev/shm peak growth |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (transport, n), m in sorted(med.items()):
        # nccl: the broadcast happens inside the servers' apply (receive and load are one), so there is no
        # transfer time apart from it
        apart = "-" if transport.startswith("nccl") else f"{m['transfer_gbps']:.3f}"
        print(
            f"| {transport} | {n} | {m['wall']:.2f} | {m['gbps']:.3f} | {m['apply']:.2f} | "
            f"{apart} | {m['learner_cpu']:.2f} | "
            f"{m['server_cpu']:.2f} | {m['stage_per_server'] / MIB:.0f} MiB | {m['shared'] / MIB:.0f} MiB | "
            f"{m['shm'] / MIB:.0f} MiB |"
        )
    lo, hi = min(sizes), max(sizes)
    fields = [f"gib={args.gib}", f"backend={args.backend}", f"rounds={args.rounds}"]
    for t in transports:
        fields.append(f"{t}_gbps_{lo}={med[(t, lo)]['gbps']:.3f}")
        fields.append(f"learner_cpu_{hi}v{lo}_{t}={med[(t, hi)]['learner_cpu'] / med[(t, lo)]['learner_cpu']:.2f}")
        # what one server stages beyond what it held, against the goal: the replaced tensors + 2 frames
        worst = max(m["stage_per_server"] for (tt, _), m in med.items() if tt == t)
        fields.append(f"stage_over_bound_{t}={worst / (update + 2 * DEFAULT_FRAME_BYTES):.2f}")
    if builds:
        print(f"weight-transfer group built in {statistics.median(builds):.2f} s (median of {len(builds)})")
        fields.append(f"group_build_s={statistics.median(builds):.2f}")
    if "grpc" in transports and "nccl" in transports:
        fields.append(f"nccl_vs_grpc_{lo}={med[('nccl', lo)]['gbps'] / med[('grpc', lo)]['gbps']:.2f}")
        fields.append(f"nccl_vs_grpc_{hi}={med[('nccl', hi)]['gbps'] / med[('grpc', hi)]['gbps']:.2f}")
    for t, n in collectives.items():
        fields.append(f"collectives_{t}={n}")
    if "nccl" in transports and "nccl_bucketed" in transports:
        fields.append(f"bucket_mb={args.bucket_mb}")
        for n in sorted({lo, hi}):  # one key when one pool size was asked for
            fields.append(
                f"bucketed_vs_per_tensor_{n}={med[('nccl_bucketed', n)]['gbps'] / med[('nccl', n)]['gbps']:.2f}"
            )
    if "grpc" in transports and "shm" in transports:
        fields.append(f"shm_vs_grpc_{lo}={med[('shm', lo)]['gbps'] / med[('grpc', lo)]['gbps']:.2f}")
        fields.append(
            f"shm_vs_grpc_{lo}_without_apply="
            f"{med[('shm', lo)]['transfer_gbps'] / med[('grpc', lo)]['transfer_gbps']:.2f}"
        )
    print("RESULT " + " ".join(fields))


def _client(pool: ServerPool, model, transport: str, shared: Path, bucket_mb: int) -> WeightSyncClient:
    """`transport` as the benchmark names it: nccl_bucketed is transport nccl with buckets of `bucket_mb` MiB."""
    bucketed = transport == "nccl_bucketed"
    return WeightSyncClient(
        pool,
        model,
        dtype="float32",
        transport="nccl" if bucketed else transport,
        shared_dir=str(shared),
        timeout_s=1800,
        group_backend="rmsft_gloo",
        group_timeout_s=600,
        group_bucket_bytes=bucket_mb * MIB if bucketed else 0,
    )


if __name__ == "__main__":
    main()
