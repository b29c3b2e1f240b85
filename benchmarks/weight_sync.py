"""Weight sync over loopback: rmsft UpdateWeights (gRPC stream) vs the same bytes over plain TCP.

    python benchmarks/weight_sync.py [--gib 1.0] [--backend vllm] [--frame-mib 4] [--sender both]

Builds a random Qwen2 checkpoint of >= --gib GiB (tokenizer of the tiny model), starts
`rmsft serve` on it, streams a FULL update of new random weights (sent as the learner sends them:
pre-serialized requests from `rmsft.wire_encode`; with `--sender both` also as protobuf messages
through the generated stub, the path before that encoder) and, in the same run, sends the
same tensor bytes over a plain TCP socket to a receiver process, twice: once discarding them
(the raw socket ceiling) and once doing what the server does with them (digest + write into a
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

from rmsft.weights_wire import BLAKE3, FULL, SHA256, new_hash  # noqa: E402
from rmsft.wire_encode import encode_weight_stream, iter_weight_chunks, update_weights_raw  # noqa: E402
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
mode, staging, algo = sys.argv[1], sys.argv[2], sys.argv[3]
if algo == "blake3":
    from blake3 import blake3 as new_hash
else:
    new_hash = hashlib.sha256
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
total = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
frame = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
buf = bytearray(frame); view = memoryview(buf)
digest = new_hash()
fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) if mode != "discard" else None
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
if mode == "verify":
    want = conn.recv(32, socket.MSG_WAITALL)
    if want != digest.digest(): raise SystemExit("digest mismatch")
conn.sendall(b"k")
if fd is not None:
    os.close(fd); os.unlink(staging)
"""


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def tcp_send(tensors, total: int, frame: int, mode: str, algo: str) -> tuple[float, float, float]:
    """Seconds, sender CPU seconds, receiver CPU seconds (the receiver's whole life). `algo`:
    "blake3" or "sha256", the stream's digest (the receiver script picks it by name)."""
    staging = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                           f"rmsft-bench-tcp-{os.getpid()}")
    rx = subprocess.Popen([sys.executable, "-c", RECEIVER, mode, staging, algo], stdout=subprocess.PIPE, text=True)
    port = int(rx.stdout.readline())
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    t0, c0 = time.perf_counter(), _cpu()
    s.sendall(total.to_bytes(8, "little") + frame.to_bytes(8, "little"))
    digest = new_hash(BLAKE3 if algo == "blake3" else SHA256) if mode == "verify" else None
    for _, t in tensors:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        mv = memoryview(flat)
        for off in range(0, len(mv), frame):
            if digest is not None:
                digest.update(mv[off : off + frame])
            s.sendall(mv[off : off + frame])
    if digest is not None:
        s.sendall(digest.digest())
    assert s.recv(1) == b"k"
    dt, cpu = time.perf_counter() - t0, _cpu() - c0
    s.close()
    _, status, usage = os.wait4(rx.pid, 0)
    rx.returncode = os.waitstatus_to_exitcode(status)
    if rx.returncode != 0:
        raise SystemExit(f"TCP receiver ({mode}) failed with exit code {rx.returncode}")
    return dt, cpu, usage.ru_utime + usage.ru_stime


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class MemSampler(threading.Thread):
    """Peak memory of the server during one sync.

    Server process: the kernel's exact high-water mark (VmHWM, reset through
    /proc/PID/clear_refs just before the sync), so a short spike between samples is not
    missed; where the reset is not allowed, samples every 20 ms. Engine child processes and
    /dev/shm: sampled every 20 ms (from another process, off the measured processes' CPUs as far
    as 2 cores allow).
    """

    def __init__(self, pid: int, shm: str):
        super().__init__(daemon=True)
        self.pid = pid
        self.proc = psutil.Process(pid)
        self.shm = shm
        self.stop_evt = threading.Event()
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # VmHWM := current RSS
            self.exact = True
        except OSError:
            self.exact = False
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

    def finish(self) -> dict[str, int]:
        self.stop_evt.set()
        self.join()
        if self.exact:
            self.peak["server"] = max(self.peak["server"], _status_kib(self.pid, "VmHWM") * 1024)
        return {k: self.peak[k] - self.base[k] for k in self.base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size to stream")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--frame-mib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of (gRPC sync, TCP raw, TCP stage, TCP verified); best round per path")
    ap.add_argument("--digest", default="blake3", choices=["blake3", "sha256"],
                    help="stream digest; the TCP baselines hash with the same algorithm")
    ap.add_argument("--kv-mib", type=int, default=256, help="--kv-cache-bytes for the server, in MiB")
    ap.add_argument("--sender", default="both", choices=["raw", "proto", "both"],
                    help="gRPC request path: raw = pre-serialized bytes (the learner's), proto = "
                         "WeightChunk messages through the generated stub; both = each, every round")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "rmsft-bench-sync-model"))
    args = ap.parse_args()
    frame = int(args.frame_mib * MIB)
    digest = BLAKE3 if args.digest == "blake3" else SHA256
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
    gbps = lambda sec: total / sec / 1e9  # noqa: E731

    print(f"starting rmsft serve (backend={args.backend}) ...", flush=True)
    t0 = time.perf_counter()
    senders = ["raw", "proto"] if args.sender == "both" else [args.sender]
    runs: dict[str, list[float]] = {"grpc_e2e": [], "apply": [], "raw": [], "stage": [], "verify": []}
    cpu: dict[str, list[tuple[float, float]]] = {"raw": [], "stage": [], "verify": []}
    for sender in senders:
        runs[f"grpc_{sender}"], cpu[f"grpc_{sender}"] = [], []
    mem: list[dict[str, int]] = []
    version = 0
    with RolloutServer.start(model_dir, backend=args.backend, dtype="float32", max_model_len=512,
                             kv_cache_bytes=args.kv_mib * MIB,
                             max_frame_bytes=2 * frame, timeout=900) as srv:
        print(f"server ready in {time.perf_counter() - t0:.0f}s", flush=True)
        for rnd in range(args.rounds):
            line = [f"round {rnd + 1}:"]
            for sender in senders:
                version += 1
                sampler = MemSampler(srv.proc.pid, "/dev/shm")
                sampler.start()
                server_proc = psutil.Process(srv.proc.pid)
                s0, c0 = sum(server_proc.cpu_times()[:2]), _cpu()
                t1 = time.perf_counter()
                if sender == "raw":
                    _, requests = encode_weight_stream(tensors, version=version, mode=FULL, frame_bytes=frame,
                                                       digest=digest)
                    call = update_weights_raw(srv.channel())
                else:
                    requests = iter_weight_chunks(tensors, version=version, mode=FULL, frame_bytes=frame,
                                                  digest=digest)
                    call = srv.stub().UpdateWeights
                reply = call(requests, metadata=srv.metadata(), timeout=1800)
                grpc_total = time.perf_counter() - t1
                # The server's apply runs in the engine process (vLLM), so this is the receive side.
                cpu[f"grpc_{sender}"].append((_cpu() - c0, sum(server_proc.cpu_times()[:2]) - s0))
                mem.append(sampler.finish())
                exact = sampler.exact
                # The server verified the digest trailer, names, shapes and counts before applying.
                assert reply.version == version and reply.bytes_received == total, reply
                runs[f"grpc_{sender}"].append(grpc_total - reply.apply_seconds)
                runs["grpc_e2e"].append(grpc_total)
                runs["apply"].append(reply.apply_seconds)
                line.append(f"gRPC {sender} {gbps(runs[f'grpc_{sender}'][-1]):.3f} GB/s "
                            f"(+{reply.apply_seconds:.2f}s apply, server RSS +{mem[-1]['server'] / MIB:.0f} MiB)")
            for mode, key in (("discard", "raw"), ("stage", "stage"), ("verify", "verify")):
                dt, c_send, c_recv = tcp_send(tensors, total, frame, mode, args.digest)
                runs[key].append(dt)
                cpu[key].append((c_send, c_recv))
            line.append(f"TCP raw {gbps(runs['raw'][-1]):.3f}  stage {gbps(runs['stage'][-1]):.3f}  "
                        f"verified {gbps(runs['verify'][-1]):.3f} GB/s")
            print("  ".join(line), flush=True)

    best = {k: min(v) for k, v in runs.items()}
    main_sender = senders[0]
    grpc_wire = best[f"grpc_{main_sender}"]
    print(f"best of {args.rounds} rounds per path (a busy shared machine only ever slows a path down):")
    for sender in senders:
        what = "pre-serialized (learner)" if sender == "raw" else "protobuf messages"
        print(f"gRPC UpdateWeights, {what:<26} stream+stage+verify: {best[f'grpc_{sender}']:.2f}s  "
              f"{gbps(best[f'grpc_{sender}']):.3f} GB/s")
    print(f"end to end incl. apply ({args.backend}), best sync: {gbps(best['grpc_e2e']):.3f} GB/s")
    for key, what in (("raw", "receiver discards"), ("stage", f"receiver {args.digest} + /dev/shm"),
                      ("verify", f"sender {args.digest} too, receiver checks")):
        print(f"plain TCP, {what:<38} {best[key]:.2f}s  {gbps(best[key]):.3f} GB/s")
    r_stage, r_verify, r_raw = (best[k] / grpc_wire for k in ("stage", "verify", "raw"))
    print(f"ratio gRPC ({main_sender})/TCP-stage: {r_stage:.2f} (target >= 0.8)   gRPC/TCP-verified: "
          f"{r_verify:.2f}   gRPC/raw socket: {r_raw:.2f}")
    speedup = best["grpc_proto"] / best["grpc_raw"] if len(senders) == 2 else float("nan")
    if len(senders) == 2:
        print(f"pre-serialized vs protobuf-message sender: {speedup:.2f}x")
    gb = total / 1e9
    per_gb = {k: (min(c for c, _ in v) / gb, min(r for _, r in v) / gb) for k, v in cpu.items()}
    print("CPU seconds per GB, sender / receiver (least over rounds; load-independent, unlike GB/s):")
    for key in [f"grpc_{x}" for x in senders] + ["raw", "stage", "verify"]:
        what = {"grpc_raw": "gRPC pre-serialized (client / server)",
                "grpc_proto": "gRPC protobuf msgs (client / server)", "raw": "TCP raw",
                "stage": "TCP stage", "verify": "TCP verified"}[key]
        print(f"  {what:<40} {per_gb[key][0]:.2f} / {per_gb[key][1]:.2f}")
    cold, warm = mem[0], mem[-1]
    how = "exact VmHWM" if exact else "20 ms samples"
    print(f"server peak extra memory ({how}): gRPC process RSS first sync +{cold['server'] / MIB:.0f} MiB "
          f"({cold['server'] / frame:.1f} frames), last sync +{warm['server'] / MIB:.0f} MiB "
          f"({warm['server'] / frame:.1f} frames); engine processes RSS +{cold['engine'] / MIB:.0f} MiB; "
          f"/dev/shm +{cold['shm'] / MIB:.0f} MiB (staging = {total / MIB:.0f} MiB)")
    result = [
        f"bytes={total}", f"frame_bytes={frame}", f"backend={args.backend}", f"rounds={args.rounds}",
        f"sender={args.sender}", f"digest={args.digest}", f"grpc_gbps={gbps(grpc_wire):.3f}",
    ]
    if len(senders) == 2:
        result += [f"grpc_proto_gbps={gbps(best['grpc_proto']):.3f}", f"raw_vs_proto={speedup:.2f}"]
    result += [
        f"grpc_e2e_gbps={gbps(best['grpc_e2e']):.3f}", f"apply_s={best['apply']:.2f}",
        f"tcp_raw_gbps={gbps(best['raw']):.3f}", f"tcp_stage_gbps={gbps(best['stage']):.3f}",
        f"tcp_verified_gbps={gbps(best['verify']):.3f}", f"ratio_vs_tcp_stage={r_stage:.2f}",
        f"ratio_vs_tcp_verified={r_verify:.2f}", f"ratio_vs_tcp_raw={r_raw:.2f}",
        f"server_extra_rss_mib={cold['server'] / MIB:.0f}", f"server_extra_frames={cold['server'] / frame:.1f}",
        f"server_extra_frames_last={warm['server'] / frame:.1f}",
    ]
    for key, label in [(f"grpc_{x}", "grpc" if x == main_sender else f"grpc_{x}") for x in senders] + [
        ("stage", "tcp_stage"), ("verify", "tcp_verified")
    ]:
        result.append(f"{label}_cpu_s_per_gb={per_gb[key][0]:.2f}/{per_gb[key][1]:.2f}")
    result += [f"engine_extra_rss_mib={cold['engine'] / MIB:.0f}", f"shm_extra_mib={cold['shm'] / MIB:.0f}",
               "digest_ok=True"]
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
