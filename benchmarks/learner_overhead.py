"""Learner-side overhead of a rollout phase, and how it scales with the number of rollout servers.

S in {1, 2, 4} rollout servers run as separate processes on loopback; each answers a Generate call
after a fixed delay per prompt, one call at a time (no model), with realistic prompt/response sizes.
The learner's RolloutClient sends N prompts (per-request seeds, expected weight version, generate
batch size; two calls in flight per server, the client's default when this was measured: a fake server
that runs one call at a time gains nothing from more) and we time the whole call. Per-prompt
overhead = (client time - the busiest server's busy time) / its prompts: everything on the critical
path that is not the server's delay (splitting, protobuf, gRPC, reassembly, version checks).
Speed-up = time(S=1) / time(S). At S=1 the client with one call in flight is also compared with a
bare gRPC loop over the same chunks, which isolates the learner's own code.

    python benchmarks/learner_overhead.py            # defaults: N=256, 4 ms/prompt, batch 8
    python benchmarks/learner_overhead.py --quick    # fewer repeats

Ends with `RESULT per_request_overhead_ms=... speedup_4=...` (targets: <= 1 ms, >= 3.6 = 0.9 x 4).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protos"))

import grpc
from rmsft_protos import rollout_pb2, rollout_pb2_grpc

from rmsft.weight_wire import WeightVersion, set_version, version_of

# The servers hold weight version 1 of this run, the learner's pool is this run's: what a sync would leave.
RUN = WeightVersion("bench0000001", 1)


class DelayServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Answers after `delay_s` per prompt with `response_len` tokens, one call at a time; enforces the
    weight version."""

    def __init__(self, delay_s: float, response_len: int, version: WeightVersion) -> None:
        # One engine slot (the conservative case; rmsft serve's engine now overlaps calls): calls queue.
        self.engine = threading.Lock()
        self.delay_s = delay_s
        self.response = list(range(100, 100 + response_len))
        self.version = version

    def Generate(self, request, context):  # gRPC method name
        expected = version_of(request)
        if expected is not None and expected != self.version:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "stale")
        with self.engine:
            time.sleep(self.delay_s * len(request.prompts))
        out = set_version(rollout_pb2.GenerateResponse(), self.version)
        for p in request.prompts:
            set_version(
                out.completions.add(
                    prompt_token_ids=p.token_ids,
                    token_ids=self.response,
                    finish_reason=rollout_pb2.STOP,
                    request_id=p.request_id,
                ),
                self.version,
            )
        return out

    def GetStatus(self, request, context):
        return set_version(rollout_pb2.StatusReply(model="delay", ready=True, backend="delay"), self.version)


def serve(delay_ms: float, response_len: int, version: WeightVersion) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(DelayServicer(delay_ms / 1000, response_len, version), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def start_servers(n: int, args: argparse.Namespace) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addrs = [], []
    for _ in range(n):
        p = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve",
                "--delay-ms",
                str(args.delay_ms),
                "--response-len",
                str(args.response_len),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
    for p in procs:
        line = p.stdout.readline().strip()
        if not line.isdigit():
            raise RuntimeError(f"benchmark server did not start (printed {line!r})")
        addrs.append(f"127.0.0.1:{line}")
    return procs, addrs


def raw_grpc_time(address: str, reqs: list, args: argparse.Namespace) -> float:
    """The transport floor: the same chunks sent one after the other with a bare stub (prompt protos
    built beforehand, replies not converted), median over the repeats."""
    from learner.rollouts.requests import to_prompt_proto

    prompts = [to_prompt_proto(r) for r in reqs]
    channel = grpc.insecure_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for k in range(0, len(prompts), args.batch):
            stub.Generate(set_version(rollout_pb2.GenerateRequest(prompts=prompts[k : k + args.batch]), RUN))
        times.append(time.perf_counter() - t0)
    channel.close()
    return statistics.median(times)


def sequential_client_time(pool, reqs: list, sampling: dict, args: argparse.Namespace) -> float:
    """The RolloutClient with one call in flight: the same call pattern as the bare loop, so the
    difference is the learner's own code (planning, protos, reassembly, version checks)."""
    from learner.rollouts.client import RolloutClient

    client = RolloutClient(pool, generate_batch_size=args.batch, max_inflight_per_server=1)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        client.generate(reqs, sampling)
        times.append(time.perf_counter() - t0)
    client.close()
    return statistics.median(times)


def run(args: argparse.Namespace) -> None:
    from learner.rollouts.client import RolloutClient, RolloutRequest
    from learner.rollouts.pool import ServerPool

    n = args.prompts
    reqs = [
        RolloutRequest(
            token_ids=[(i * 7 + j) % 2000 for j in range(args.prompt_len)], seed=1000 + i, request_id=f"r{i}"
        )
        for i in range(n)
    ]
    sampling = {"max_tokens": args.response_len, "temperature": 1.0, "top_p": 0.95}
    procs, addrs = start_servers(max(args.servers), args)
    rows = []
    raw_s = seq_s = 0.0
    try:
        for s in args.servers:
            pool = ServerPool(addrs[:s], run_id=RUN.run_id)
            pool.wait_ready(timeout_s=30)
            pool.set_current_version(RUN.number)
            client = RolloutClient(pool, generate_batch_size=args.batch, max_inflight_per_server=2)
            client.generate(reqs[: 2 * s * args.batch], sampling)  # warm up channels and threads
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = client.generate(reqs, sampling)
                times.append(time.perf_counter() - t0)
                assert len(out) == n and all(o.weights == RUN for o in out)
                assert [o.request_id for o in out] == [r.request_id for r in reqs]
            per_server = -(-n // s)  # the busiest server's prompts: the critical path
            busy = per_server * args.delay_ms / 1000
            t = statistics.median(times)
            calls = -(-per_server // args.batch)
            rows.append(
                {
                    "servers": s,
                    "time_s": t,
                    "busy_s": busy,
                    "overhead_ms_per_prompt": (t - busy) / per_server * 1e3,
                    "overhead_ms_per_call": (t - busy) / calls * 1e3,
                    "min_s": min(times),
                }
            )
            if s == 1:
                raw_s = raw_grpc_time(addrs[0], reqs, args)
                seq_s = sequential_client_time(pool, reqs, sampling, args)
            client.close()
            pool.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)

    t1 = rows[0]["time_s"]
    print(
        f"\nN={n} prompts ({args.prompt_len} prompt + {args.response_len} response tokens), server delay "
        f"{args.delay_ms} ms/prompt, generate batch {args.batch}, median of {args.repeats} runs"
    )
    print(
        f"{'servers':>7} {'time s':>8} {'ideal s':>8} {'speed-up':>9} {'x/S':>6} {'ovh ms/prompt':>14} "
        f"{'ovh ms/call':>12}"
    )
    for r in rows:
        sp = t1 / r["time_s"]
        print(
            f"{r['servers']:>7} {r['time_s']:>8.3f} {r['busy_s']:>8.3f} {sp:>9.2f} {sp / r['servers']:>6.2f} "
            f"{r['overhead_ms_per_prompt']:>14.3f} {r['overhead_ms_per_call']:>12.3f}"
        )
    code_ms = (seq_s - raw_s) / n * 1e3
    print(
        f"1 server, one call in flight: bare gRPC loop {raw_s:.3f} s (transport + server encoding "
        f"{(raw_s - rows[0]['busy_s']) / n * 1e3:.3f} ms/prompt), RolloutClient {seq_s:.3f} s: the learner's "
        f"own code adds {code_ms:.3f} ms/prompt; two calls in flight hide the round trip: {t1:.3f} s"
    )
    worst = max(r["overhead_ms_per_prompt"] for r in rows)
    top = rows[-1]
    print(
        f"RESULT per_request_overhead_ms={worst:.3f} speedup_{top['servers']}={t1 / top['time_s']:.2f} "
        f"efficiency_{top['servers']}={t1 / top['time_s'] / top['servers']:.2f} "
        f"client_code_ms_per_prompt={code_ms:.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--delay-ms", type=float, default=4.0, help="server time per prompt")
    ap.add_argument("--batch", type=int, default=8, help="generate batch size (prompts per call)")
    ap.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 repeats")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.delay_ms, args.response_len, version=RUN)
        return
    if args.quick:
        args.repeats = 2
    if args.servers[0] != 1:
        ap.error("--servers must start with 1 (speed-ups are relative to one server)")
    run(args)


if __name__ == "__main__":
    main()
