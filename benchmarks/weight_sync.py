"""Weight sync over loopback: rmsft UpdateWeights (gRPC stream) vs the same bytes over plain TCP.

    python benchmarks/weight_sync.py [--gib 1.0] [--backend vllm] [--frame-mib 4]

Builds a random Qwen2 checkpoint of >= --gib GiB (tokenizer of the tiny model), starts
`rmsft serve` on it, streams a FULL update of new random weights and, in the same run, sends the
same tensor bytes over a plain TCP socket to a receiver process, twice: once discarding them
(the raw socket ceiling) and once doing what the server does with them (sha256 + write into a
staging file in /dev/shm). Server memory is sampled every 20 ms during the sync.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rmsft.weights_wire import FULL, iter_weight_chunks  # noqa: E402
from rollout_svc.launcher import RolloutServer  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20


def build_model(out: Path, gib: float) -> None:
    """Random Qwen2 with enough layers to reach `gib` GiB of float32 weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rmsft.tiny_model import build_tokenizer

    marker = out / "bench.json"
    if marker.exists() and json.loads(marker.read_text()).get("gib") == gib:
        return
    tok = build_tokenizer(0)
    hidden, inter = 1024, 4096
    per_layer = 4 * (hidden * hidden * 2 + hidden * 64 * 2 + 3 * hidden * inter)
    layers = max(1, int(gib * GIB / per_layer) + 1)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    print(f"building a {layers}-layer random Qwen2 in {out} ...", flush=True)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    marker.write_text(json.dumps({"gib": gib}))


RECEIVER = r"""
import hashlib, os, socket, sys
mode, staging = sys.argv[1], sys.argv[2]
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
total = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
frame = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
buf = bytearray(frame); view = memoryview(buf)
digest = hashlib.sha256()
fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) if mode == "stage" else None
if fd is not None:
    os.posix_fallocate(fd, 0, total)
got = 0
while got < total:
    want = min(frame, total - got); n = 0
    while n < want:
        r = conn.recv_into(view[n:want])
        if not r: raise SystemExit("sender went away")
        n += r
    if fd is not None:
        digest.update(view[:n]); os.pwrite(fd, view[:n], got)
    got += n
conn.sendall(b"k")
if fd is not None:
    os.close(fd); os.unlink(staging)
"""


def tcp_send(tensors, total: int, frame: int, mode: str) -> float:
    staging = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                           f"rmsft-bench-tcp-{os.getpid()}")
    rx = subprocess.Popen([sys.executable, "-c", RECEIVER, mode, staging], stdout=subprocess.PIPE, text=True)
    port = int(rx.stdout.readline())
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    t0 = time.perf_counter()
    s.sendall(total.to_bytes(8, "little") + frame.to_bytes(8, "little"))
    for _, t in tensors:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        mv = memoryview(flat)
        for off in range(0, len(mv), frame):
            s.sendall(mv[off : off + frame])
    assert s.recv(1) == b"k"
    dt = time.perf_counter() - t0
    s.close()
    rx.wait(30)
    return dt


class MemSampler(threading.Thread):
    """Peak RSS of the server process and (separately) its children, plus /dev/shm usage."""

    def __init__(self, pid: int, shm: str):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.shm = shm
        self.stop_evt = threading.Event()
        self.base = self.sample()
        self.peak = dict(self.base)

    def sample(self) -> dict[str, int]:
        main = self.proc.memory_info().rss
        kids = 0
        for c in self.proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                kids += c.memory_info().rss
        shm = psutil.disk_usage(self.shm).used if os.path.isdir(self.shm) else 0
        return {"server": main, "engine": kids, "shm": shm}

    def run(self) -> None:
        while not self.stop_evt.is_set():
            s = self.sample()
            for k, v in s.items():
                self.peak[k] = max(self.peak[k], v)
            time.sleep(0.02)

    def extra(self) -> dict[str, int]:
        return {k: self.peak[k] - self.base[k] for k in self.base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size to stream")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--frame-mib", type=float, default=4.0)
    ap.add_argument("--kv-fraction", type=float, default=0.15,
                    help="--gpu-memory-utilization for the server (CPU: share of RAM for weights + KV cache)")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "rmsft-bench-sync-model"))
    args = ap.parse_args()
    frame = int(args.frame_mib * MIB)
    model_dir = Path(args.model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    build_model(model_dir, args.gib)

    from safetensors.torch import load_file

    # New weights = the checkpoint's tensors scaled and perturbed (random, same names/shapes/dtypes).
    tensors = []
    g = torch.Generator().manual_seed(1)
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, t in sorted(load_file(f).items()):
            tensors.append((name, t + 0.01 * torch.randn(t.shape, generator=g, dtype=t.dtype)))
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    print(f"{len(tensors)} tensors, {total / GIB:.2f} GiB, frame {frame / MIB:g} MiB", flush=True)

    print(f"starting rmsft serve (backend={args.backend}) ...", flush=True)
    t0 = time.perf_counter()
    with RolloutServer.start(model_dir, backend=args.backend, dtype="float32", max_model_len=512,
                             gpu_memory_utilization=args.kv_fraction,
                             max_frame_bytes=2 * frame, timeout=900) as srv:
        print(f"server ready in {time.perf_counter() - t0:.0f}s", flush=True)
        sampler = MemSampler(srv.proc.pid, "/dev/shm")
        sampler.start()
        chunks = iter_weight_chunks(tensors, version=1, mode=FULL, frame_bytes=frame)
        t1 = time.perf_counter()
        reply = srv.stub().UpdateWeights(chunks, metadata=srv.metadata(), timeout=1800)
        grpc_total = time.perf_counter() - t1
        sampler.stop_evt.set()
        sampler.join()
        extra = sampler.extra()
        assert reply.version == 1 and reply.bytes_received == total
        digest_ok = True
    grpc_wire = grpc_total - reply.apply_seconds

    tcp_raw = tcp_send(tensors, total, frame, "discard")
    tcp_stage = tcp_send(tensors, total, frame, "stage")

    gbps = lambda sec: total / sec / 1e9  # noqa: E731
    print(f"gRPC UpdateWeights: {grpc_total:.2f}s total = {grpc_wire:.2f}s stream+stage+verify "
          f"+ {reply.apply_seconds:.2f}s apply ({args.backend})")
    print(f"  stream+stage+verify: {gbps(grpc_wire):.2f} GB/s   end to end incl. apply: {gbps(grpc_total):.2f} GB/s")
    print(f"plain TCP, receiver discards:          {tcp_raw:.2f}s  {gbps(tcp_raw):.2f} GB/s")
    print(f"plain TCP, receiver sha256 + /dev/shm: {tcp_stage:.2f}s  {gbps(tcp_stage):.2f} GB/s")
    r_stage = tcp_stage / grpc_wire
    r_raw = tcp_raw / grpc_wire
    print(f"ratio gRPC/TCP (same staging work): {r_stage:.2f} (target >= 0.8)   gRPC/raw socket: {r_raw:.2f}")
    print(f"server peak extra memory: gRPC process RSS +{extra['server'] / MIB:.0f} MiB "
          f"({extra['server'] / frame:.1f} frames), engine processes RSS +{extra['engine'] / MIB:.0f} MiB, "
          f"/dev/shm +{extra['shm'] / MIB:.0f} MiB (staging = {total / MIB:.0f} MiB)")
    print(
        f"RESULT bytes={total} frame_bytes={frame} backend={args.backend} "
        f"grpc_gbps={gbps(grpc_wire):.3f} grpc_e2e_gbps={gbps(grpc_total):.3f} "
        f"apply_s={reply.apply_seconds:.2f} tcp_raw_gbps={gbps(tcp_raw):.3f} "
        f"tcp_stage_gbps={gbps(tcp_stage):.3f} ratio_vs_tcp_stage={r_stage:.2f} ratio_vs_tcp_raw={r_raw:.2f} "
        f"server_extra_rss_mib={extra['server'] / MIB:.0f} server_extra_frames={extra['server'] / frame:.1f} "
        f"engine_extra_rss_mib={extra['engine'] / MIB:.0f} shm_extra_mib={extra['shm'] / MIB:.0f} "
        f"digest_ok={digest_ok}"
    )


if __name__ == "__main__":
    main()
