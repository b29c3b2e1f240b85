"""A real gRPC rollout server on loopback with a fake engine, for the learner's client tests.

The engine answers deterministically from the prompt and its seed, so a chunk answered by any
server gives the same completion. Faults are switched on per server: stop (the process dies),
delay, a wrong version in replies, FAILED_PRECONDITION, rejecting ADAPTER updates.
Weight updates are verified with the real wire reader and kept for the test to inspect.

Weight versions follow the real server's rules (rmsft.weight_wire.version): the engine holds a run
id with its version number, takes both from an update's header, reports both, and refuses a
Generate fenced to another pair. An engine made at version > 0 holds that version of `FAKE_RUN`
(the run of the pools the tests build with `run_id=FAKE_RUN`), as if that run had synced it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch
from rmsft_protos import rollout_pb2, rollout_pb2_grpc

from rmsft.weight_wire import (
    ADAPTER,
    NO_RUN,
    StreamReader,
    WeightVersion,
    WireError,
    mismatch_message,
    set_version,
    torch_dtype,
    version_of,
)
from rollout_engine.prompts import sample_seed
from rollout_svc.server import GENERATE_RECEIVE_BYTES

FAKE_RUN = "fakerun00001"  # the learner run of engines made at version > 0 (and of the tests' pools)


def fake_tokens(prompt_ids: list[int], seed: int | None) -> list[int]:
    """What the fake engine 'generates': a pure function of the prompt and the seed."""
    s = 0 if seed is None else seed
    base = sum((i + 1) * t for i, t in enumerate(prompt_ids))
    return [(base * 31 + s * 7 + k) % 1000 for k in range(3 + (s % 3))]


@functools.lru_cache(maxsize=4)
def chat_renderer(model_dir: str) -> Callable[[list[dict[str, str]]], list[int]]:
    """What a real server serving `model_dir` renders for chat messages (its tokenizer's chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def render(messages: list[dict[str, str]]) -> list[int]:
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]

    return render


@dataclass
class Received:
    header: rollout_pb2.WeightHeader
    tensors: dict[str, torch.Tensor]
    max_piece_bytes: int


@dataclass
class FakeEngine(rollout_pb2_grpc.RolloutServiceServicer):
    ordinal: int = 0
    version: int = 0
    run_id: str | None = None  # None: FAKE_RUN at a version > 0, NO_RUN (a fresh server) at 0
    lora_enabled: bool = False
    max_lora_rank: int = 64
    delay_s: float = 0.0
    gate: threading.Event | None = None  # Generate answers (or fails) once it is set, 30 s at most: an order
    reply_version: int | None = None  # answer with this version, ignoring the fence (expected version)
    reply_run_id: str | None = None  # answer with this run id, ignoring the fence
    fail_generate: grpc.StatusCode | None = None
    fail_times: int = 10**9  # how many Generate calls fail while fail_generate is set
    reject_adapter: bool = False
    token: str | None = None
    active_adapter: str = ""
    abort_update_after: tuple[int, grpc.StatusCode] | None = None  # (pieces, code): die mid-stream
    calls: list[list[tuple[str, int | None]]] = field(default_factory=list)
    samplings: list[tuple[float, int]] = field(default_factory=list)  # (temperature, n) of each Generate call
    updates: list[Received] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    inflight: int = 0
    max_inflight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Renders chat messages as a real server of the learner's model would (`chat_renderer(model_dir)`): the
    # learner checks the prompt ids it gets back against its own.
    render: Callable[[list[dict[str, str]]], list[int]] | None = None
    # What the engine answers, (prompt ids, temperature, seed) -> token ids; None: `fake_tokens`.
    answer: Callable[[list[int], float, int | None], list[int]] | None = None

    def __post_init__(self) -> None:
        if self.run_id is None:
            self.run_id = FAKE_RUN if self.version else NO_RUN

    @property
    def weights(self) -> WeightVersion:
        return WeightVersion(self.run_id, self.version)

    def hold(self, weights: WeightVersion) -> None:
        """Hold `weights` (what an applied update of that version leaves)."""
        with self.lock:
            self.run_id, self.version = weights.run_id, weights.number

    def _auth(self, context: grpc.ServicerContext) -> None:
        md = dict(context.invocation_metadata())
        with self.lock:
            self.metadata.append(md)
        if self.token is not None and md.get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

    def Generate(self, request, context):  # gRPC method name
        self._auth(context)
        with self.lock:
            self.calls.append([(p.request_id, p.seed if p.HasField("seed") else None) for p in request.prompts])
            self.samplings.append((round(request.sampling.temperature, 3), request.sampling.n or 1))
            self.events.append("generate")
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            fail = self.fail_generate if self.fail_times > 0 else None
            if fail is not None:
                self.fail_times -= 1
        try:
            if self.gate is not None:
                self.gate.wait(30)
            if fail is not None:
                context.abort(fail, f"injected {fail.name} on server {self.ordinal}")
            expected = version_of(request)
            ignore_fence = self.reply_version is not None or self.reply_run_id is not None
            if not ignore_fence and expected is not None and expected != self.weights:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch_message(expected, self.weights))
            if self.delay_s:
                time.sleep(self.delay_s)
            version = WeightVersion(
                self.run_id if self.reply_run_id is None else self.reply_run_id,
                self.version if self.reply_version is None else self.reply_version,
            )
            out = set_version(rollout_pb2.GenerateResponse(), version)
            for p in request.prompts:
                ids = list(p.token_ids)
                if not ids and self.render is not None:
                    ids = self.render([{"role": m.role, "content": m.content} for m in p.messages])
                for k in range(request.sampling.n or 1):  # the real server's sample order and seed rule
                    seed = sample_seed(p.seed, k) if p.HasField("seed") else None
                    toks = (
                        fake_tokens(ids, seed)
                        if self.answer is None
                        else self.answer(ids, request.sampling.temperature, seed)
                    )
                    set_version(
                        out.completions.add(
                            prompt_token_ids=ids,
                            token_ids=toks,
                            finish_reason=rollout_pb2.STOP,
                            request_id=p.request_id,
                            sample_index=k,
                            logprobs=[-0.5] * len(toks) if request.sampling.logprobs else (),
                        ),
                        version,
                    )
            return out
        finally:
            with self.lock:
                self.inflight -= 1

    def UpdateWeights(self, request_iterator, context):
        self._auth(context)
        reader = StreamReader()
        buf = bytearray()
        biggest = 0
        pieces = 0
        received: list[rollout_pb2.WeightChunk] = []  # kept to relay them, as a real server does
        try:
            for chunk in request_iterator:
                received.append(chunk)
                if chunk.WhichOneof("kind") == "piece":
                    biggest = max(biggest, len(chunk.piece.data))
                    pieces = pieces + 1
                    if self.abort_update_after and pieces > self.abort_update_after[0]:
                        context.abort(self.abort_update_after[1], f"injected: stream broken after {pieces - 1} pieces")
                off = reader.feed(chunk)
                if chunk.WhichOneof("kind") == "header":
                    if chunk.header.mode == ADAPTER and (self.reject_adapter or not self.lora_enabled):
                        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoRA is not enabled on this server")
                    buf = bytearray(chunk.header.total_bytes)
                elif off is not None:
                    buf[off : off + len(chunk.piece.data)] = chunk.piece.data
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not reader.finished:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stream ended without a trailer")
        tensors = {}
        for t in reader.tensors:
            raw = bytes(buf[t.start : t.start + t.spec.nbytes])
            flat = torch.frombuffer(bytearray(raw), dtype=torch_dtype(t.spec.dtype)) if raw else torch.empty(0)
            tensors[t.name] = flat.reshape(t.spec.shape).clone()
        with self.lock:
            self.updates.append(Received(reader.header, tensors, biggest))
            self.run_id, self.version = reader.header.run_id, reader.header.version  # together, as the server
            self.active_adapter = f"adapter-v{self.version}" if reader.header.mode == ADAPTER else ""
            self.events.append(f"update:{reader.header.version}")
        return set_version(
            rollout_pb2.UpdateReply(
                tensors_applied=len(tensors),
                bytes_received=reader.received_bytes,
                relayed=self._relay(received, context),
            ),
            version_of(reader.header),
        )

    def _relay(self, chunks: list[rollout_pb2.WeightChunk], context) -> list[rollout_pb2.RelayOutcome]:
        """Forward the whole stream to header.relay_to, one server after the other (the real server
        forwards while it receives: rollout_svc/relay.py; the outcomes have the same shape)."""
        from rmsft.weight_wire.outcomes import outcome_of_error, relayed_from_error

        targets = list(chunks[0].header.relay_to)
        md = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        out: list[rollout_pb2.RelayOutcome] = []
        while targets:
            address, rest = targets[0], targets[1:]
            header = rollout_pb2.WeightChunk()
            header.CopyFrom(chunks[0])
            del header.header.relay_to[:]
            header.header.relay_to.extend(rest)
            with grpc.insecure_channel(address) as channel:
                stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                try:
                    reply = stub.UpdateWeights(iter([header, *chunks[1:]]), timeout=60, metadata=md)
                    ok = set_version(rollout_pb2.RelayOutcome(address=address), version_of(reply))
                    got = [ok, *reply.relayed]
                except grpc.RpcError as e:
                    got = [outcome_of_error(address, e), *relayed_from_error(e)]
            out += got
            covered = {o.address for o in got}
            targets = [a for a in rest if a not in covered]
        return out

    def GetStatus(self, request, context):
        self._auth(context)
        with self.lock:
            self.events.append("status")
        return set_version(
            rollout_pb2.StatusReply(
                model="fake",
                replica_ordinal=self.ordinal,
                ready=True,
                lora_enabled=self.lora_enabled,
                backend="fake",
                max_lora_rank=self.max_lora_rank,
                active_adapter=self.active_adapter,
            ),
            self.weights,
        )


class FakeServer:
    """One FakeEngine behind a real grpc.server on 127.0.0.1; can be stopped and restarted on the
    same port (a restarted pod comes back with a fresh engine on base weights, version 0)."""

    def __init__(self, engine: FakeEngine, port: int = 0) -> None:
        self.engine = engine
        # Accepts what `rmsft serve` accepts (rollout_svc.server.GENERATE_RECEIVE_BYTES), not grpc's 4 MiB default.
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8),
            options=[("grpc.max_receive_message_length", GENERATE_RECEIVE_BYTES)],
        )
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(engine, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        if self.port == 0:
            raise RuntimeError(f"could not bind 127.0.0.1:{port}")
        self._server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(grace=None).wait()

    def restart(self, engine: FakeEngine | None = None) -> FakeServer:
        self.stop()
        return FakeServer(engine or FakeEngine(ordinal=self.engine.ordinal), port=self.port)
