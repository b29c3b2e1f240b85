"""Weight sync client: a tiny peft model streamed to real gRPC servers on loopback (fake engines that
verify the stream with the real wire reader and keep the tensors)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import grpc
import pytest
import torch
from learner_fakes import FakeEngine, FakeServer
from safetensors.torch import load_file

from learner.rollouts.client import RolloutClient, RolloutRequest
from learner.rollouts.pool import ServerPool
from learner.sync.client import WeightSyncClient, WeightSyncError
from learner.sync.weights import adapter_named_tensors, full_named_tensors, hf_name
from learner.tracking.metrics import WEIGHT_SYNC_BYTES

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj"]


def _peft_model(model_dir: Path, *, dora: bool = False, seed: int = 0, **lora_kw):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # init_lora_weights=False: B is random too, so the adapter really changes the weights
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, use_dora=dora, **lora_kw)
    return get_peft_model(base, cfg)


@pytest.fixture(scope="module")
def lora_model(tiny_model_dir):
    return _peft_model(tiny_model_dir)


@pytest.fixture(scope="module")
def dora_model(tiny_model_dir):
    return _peft_model(tiny_model_dir, dora=True, seed=1)


@pytest.fixture
def cluster():
    made = []

    def make(n: int, **kw):
        servers = [FakeServer(FakeEngine(ordinal=i, **kw)) for i in range(n)]
        pool = ServerPool([s.address for s in servers], reprobe_interval_s=0.0)
        made.append((servers, pool))
        return servers, pool

    yield make
    for servers, pool in made:
        pool.close()
        for s in servers:
            s.stop()


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k


def _merged_reference(model) -> dict[str, torch.Tensor]:
    """What peft's own merge_and_unload gives, minus the tied lm_head (not in HF checkpoints)."""
    ref = copy.deepcopy(model).merge_and_unload().state_dict()
    ref.pop("lm_head.weight")
    return ref


# -- export ---------------------------------------------------------------------------------------
def test_hf_names_strip_peft_naming() -> None:
    assert hf_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert hf_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert hf_name("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight") is None
    assert hf_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert hf_name("base_model.model.lm_head.original_module.weight") is None
    assert hf_name("base_model.model.lm_head.modules_to_save.other.weight") is None


@pytest.mark.parametrize("which", ["lora_model", "dora_model"])
def test_full_export_equals_merged_model_and_leaves_training_model_unchanged(request, tiny_model_dir, which):
    model = request.getfixturevalue(which)
    before = _snapshot(model)
    items = full_named_tensors(model)
    _assert_same_tensors(dict(items), _merged_reference(model))
    # the names are exactly the HF checkpoint's names
    assert sorted(n for n, _ in items) == sorted(load_file(tiny_model_dir / "model.safetensors"))
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())  # bit-identical, not just close
    assert not any(getattr(m, "merged", False) for m in model.modules())


def test_full_export_can_cast(lora_model) -> None:
    items = full_named_tensors(lora_model, dtype=torch.bfloat16)
    assert {t.dtype for _, t in items} == {torch.bfloat16}


def test_adapter_export_matches_what_peft_saves(lora_model, tmp_path) -> None:
    items, config_json = adapter_named_tensors(lora_model)
    lora_model.save_pretrained(tmp_path)
    _assert_same_tensors(dict(items), load_file(tmp_path / "adapter_model.safetensors"))
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    sent = json.loads(config_json)
    assert sent["r"] == 4 and sent["use_dora"] is False and sent["inference_mode"] is True
    # auto_mapping only tells the hub which auto class to load; vLLM does not read it
    skip = {"target_modules", "auto_mapping"}
    assert {k: v for k, v in sent.items() if k not in skip} == {k: v for k, v in saved.items() if k not in skip}
    assert sorted(sent["target_modules"]) == sorted(saved["target_modules"]) == sorted(TARGETS)


# -- sync -----------------------------------------------------------------------------------------
def _bytes_sent(mode: str) -> float:
    return WEIGHT_SYNC_BYTES.labels(mode=mode)._value.get()


def test_full_sync_streams_merged_weights_in_bounded_frames_to_all_servers(cluster, lora_model) -> None:
    servers, pool = cluster(3)
    before = _snapshot(lora_model)
    sent0 = _bytes_sent("full")
    report = WeightSyncClient(pool, lora_model, mode="full", frame_bytes=64 << 10).sync(1)
    assert report.mode == "full" and sorted(report.acked) == sorted(s.address for s in servers)
    ref = _merged_reference(lora_model)
    for s in servers:
        (upd,) = s.engine.updates
        assert upd.header.version == 1 and upd.header.mode == 1  # FULL
        assert 0 < upd.max_piece_bytes <= 64 << 10
        _assert_same_tensors(upd.tensors, ref)
        assert s.engine.version == 1
    assert pool.current_version == 1 and all(pool.is_current(s) for s in pool.servers)
    assert _bytes_sent("full") - sent0 == 3 * sum(t.numel() * t.element_size() for t in ref.values())
    assert all(torch.equal(lora_model.state_dict()[k], v) for k, v in before.items())


def test_adapter_sync_sends_only_the_lora_tensors_and_config(cluster, lora_model, tmp_path) -> None:
    servers, pool = cluster(2, lora_enabled=True)
    report = WeightSyncClient(pool, lora_model, mode="adapter").sync(4)
    assert report.mode == "adapter"
    lora_model.save_pretrained(tmp_path)
    want = load_file(tmp_path / "adapter_model.safetensors")
    for s in servers:
        (upd,) = s.engine.updates
        assert upd.header.mode == 2  # ADAPTER
        assert json.loads(upd.header.adapter_config_json)["r"] == 4
        _assert_same_tensors(upd.tensors, want)


@pytest.mark.parametrize(
    ("which", "lora_enabled", "expect"),
    [("lora_model", True, "adapter"), ("lora_model", False, "full"), ("dora_model", True, "full")],
)
def test_auto_mode_choice(request, cluster, which, lora_enabled, expect) -> None:
    model = request.getfixturevalue(which)
    servers, pool = cluster(2, lora_enabled=lora_enabled)
    report = WeightSyncClient(pool, model, mode="auto").sync(1)
    assert report.mode == expect
    assert all(s.engine.updates[0].header.mode == {"full": 1, "adapter": 2}[expect] for s in servers)


def test_auto_mode_uses_full_when_one_server_lacks_lora(cluster, lora_model) -> None:
    servers, pool = cluster(2, lora_enabled=True)
    servers[1].engine.lora_enabled = False
    assert WeightSyncClient(pool, lora_model, mode="auto").sync(1).mode == "full"


def test_auto_mode_uses_full_when_rank_exceeds_server_limit(cluster, lora_model) -> None:
    _, pool = cluster(1, lora_enabled=True, max_lora_rank=2)
    assert WeightSyncClient(pool, lora_model, mode="auto").sync(1).mode == "full"


def test_fallback_to_full_after_adapter_failure_sticks_for_the_run(cluster, lora_model) -> None:
    servers, pool = cluster(2, lora_enabled=True)
    servers[1].engine.reject_adapter = True
    client = WeightSyncClient(pool, lora_model, mode="adapter", fallback_to_full=True)
    report = client.sync(1)
    assert report.fell_back and report.mode == "full"
    assert all(s.engine.version == 1 for s in servers)
    assert all(s.engine.updates[-1].header.mode == 1 for s in servers)
    servers[1].engine.reject_adapter = False
    assert client.sync(2).mode == "full"  # stays on FULL for the rest of the run
    assert "rejected" in client.forced_full_reason


def test_adapter_never_goes_on_top_of_full_updated_weights(cluster, lora_model) -> None:
    servers, pool = cluster(2, lora_enabled=True)
    WeightSyncClient(pool, lora_model, mode="full").sync(1)
    auto = WeightSyncClient(pool, lora_model, mode="auto").sync(2)
    assert auto.mode == "full"
    with pytest.raises(WeightSyncError, match="FULL-updated weights"):
        WeightSyncClient(pool, lora_model, mode="adapter", fallback_to_full=False).sync(3)
    # a new learner process only knows GetStatus: version > 0 without an adapter = FULL weights
    fresh_pool = ServerPool([s.address for s in servers])
    try:
        assert WeightSyncClient(fresh_pool, lora_model, mode="auto").sync(3).mode == "full"
    finally:
        fresh_pool.close()
    restarted = servers[0].restart(FakeEngine(ordinal=0, lora_enabled=True))  # back on the checkpoint
    servers[0] = restarted
    with ServerPool([restarted.address]) as p:
        assert WeightSyncClient(p, lora_model, mode="auto").sync(1).mode == "adapter"


def test_adapter_failure_without_fallback_raises(cluster, lora_model) -> None:
    servers, pool = cluster(2, lora_enabled=True)
    servers[0].engine.reject_adapter = True
    with pytest.raises(WeightSyncError, match="rejected by.*FAILED_PRECONDITION"):
        WeightSyncClient(pool, lora_model, mode="adapter", fallback_to_full=False).sync(1)
    assert pool.current_version is None  # not considered done


def test_adapter_mode_with_dora_is_refused_or_falls_back(cluster, dora_model) -> None:
    _, pool = cluster(1, lora_enabled=True)
    with pytest.raises(ValueError, match="DoRA"):
        WeightSyncClient(pool, dora_model, mode="adapter", fallback_to_full=False)
    assert WeightSyncClient(pool, dora_model, mode="adapter").sync(1).mode == "full"


def test_unreachable_server_is_left_out_and_marked_down(cluster, lora_model) -> None:
    servers, pool = cluster(2)
    pool.refresh()
    servers[1].stop()
    report = WeightSyncClient(pool, lora_model, timeout_s=10).sync(1)
    assert list(report.acked) == [servers[0].address] and list(report.unreachable) == [servers[1].address]
    assert not pool.servers[1].state.up and pool.is_current(pool.servers[0])


def test_no_reachable_server_is_an_error(cluster, lora_model) -> None:
    servers, pool = cluster(2)
    for s in servers:
        s.stop()
    with pytest.raises(WeightSyncError, match="no rollout server") as info:
        WeightSyncClient(pool, lora_model).sync(1)
    assert all(s.address in str(info.value) for s in servers)


def test_a_sync_with_every_server_restarting_waits_for_one(cluster, lora_model) -> None:
    """spec.rollout.recoveryTimeout (issue 41): the only server is down when a sync is due; the sync waits for it to
    come back instead of ending the run, then the new server holds the version."""
    import threading
    import time

    servers, pool = cluster(1)
    pool.refresh()
    pool.recovery_s = 30.0
    servers[0].stop()

    def back() -> None:
        time.sleep(1.0)
        servers[0] = servers[0].restart(FakeEngine(ordinal=0, version=0))

    t = threading.Thread(target=back)
    t.start()
    report = WeightSyncClient(pool, lora_model, timeout_s=10).sync(1)
    t.join()
    assert list(report.acked) == [servers[0].address] and pool.is_current(pool.servers[0])
    assert servers[0].engine.version == 1


def test_restarted_server_is_resynced_by_the_rollout_client(cluster, lora_model) -> None:
    servers, pool = cluster(2)
    sync = WeightSyncClient(pool, lora_model)
    sync.sync(3)
    rollouts = RolloutClient(pool, resync=sync.resync_server)
    reqs = [RolloutRequest(token_ids=[1, 2, i], seed=i, request_id=f"r{i}") for i in range(6)]
    assert {r.weight_version for r in rollouts.generate(reqs)} == {3}
    servers[1].stop()
    rollouts.generate(reqs)  # served by server 0 alone
    servers[1] = servers[1].restart(FakeEngine(ordinal=1, version=0))  # a restarted pod on base weights
    out = rollouts.generate(reqs)
    assert {r.weight_version for r in out} == {3}
    (upd,) = servers[1].engine.updates  # the restarted server got the full current weights first
    assert upd.header.version == 3
    _assert_same_tensors(upd.tensors, _merged_reference(lora_model))
    assert servers[1].engine.events.index("update:3") < servers[1].engine.events.index("generate")


def test_blocked_export_refuses_resync_and_the_next_sync_catches_the_server_up(cluster, lora_model) -> None:
    """ZeRO-3: rank 0 alone cannot export partitioned weights mid-rollout. The re-sync is refused
    (the rollout client then skips that server) and nothing is streamed; the next collective sync
    brings the restarted server to the new version."""
    servers, pool = cluster(2)
    sync = WeightSyncClient(pool, lora_model)
    sync.sync(3)
    sync.export_blocked = "ZeRO-3 partitions the weights"
    servers[1] = servers[1].restart(FakeEngine(ordinal=1, version=0))
    with pytest.raises(WeightSyncError, match="cannot re-sync .* now: ZeRO-3 partitions the weights"):
        sync.resync_server(pool.servers[1])
    assert servers[1].engine.updates == []
    rollouts = RolloutClient(pool, resync=sync.resync_server)
    reqs = [RolloutRequest(token_ids=[1, 2, i], seed=i, request_id=f"r{i}") for i in range(4)]
    out = rollouts.generate(reqs)  # served by server 0 alone, all from the current weights
    assert [r.request_id for r in out] == [r.request_id for r in reqs] and {r.weight_version for r in out} == {3}
    assert "generate" not in servers[1].engine.events
    sync.sync(4)  # the trainer's collective sync: export allowed there even while blocked for re-syncs
    assert [u.header.version for u in servers[1].engine.updates] == [4]


def test_rejected_stream_reports_the_server_error(cluster, lora_model) -> None:
    servers, pool = cluster(1, token="t0k")  # the client sends no token
    with pytest.raises(WeightSyncError, match=grpc.StatusCode.UNAUTHENTICATED.name):
        WeightSyncClient(pool, lora_model).sync(1, servers=pool.servers)


# -- against the real rollout server --------------------------------------------------------------
def _greedy_reference(model, prompts: list[list[int]], max_tokens: int, eos: set[int]) -> list[list[int]]:
    merged = copy.deepcopy(model).merge_and_unload() if hasattr(model, "merge_and_unload") else model
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = merged.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=sorted(eos),
            )[0, len(ids) :].tolist()
            for j, t in enumerate(gen):
                if t in eos:
                    gen = gen[: j + 1]
                    break
            out.append(gen)
    return out


def _prompts(tokenizer, n: int) -> list[list[int]]:
    texts = [f"Find every {w} in the picture." for w in ("dog", "car", "person", "red apple", "cup", "boat")]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": texts[i % len(texts)] + " " * (i // 6)}],
                tokenize=True,
                add_generation_prompt=True,
            )["input_ids"]
        )
        for i in range(n)
    ]


def _check_served_weights(pool, model, tokenizer, version: int) -> None:
    prompts = _prompts(tokenizer, 6)
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    reqs = [RolloutRequest(token_ids=p, seed=i, request_id=f"q{i}") for i, p in enumerate(prompts)]
    out = RolloutClient(pool, generate_batch_size=3).generate(reqs, {"max_tokens": 12, "temperature": 0.0})
    assert {r.weight_version for r in out} == {version}
    assert [r.token_ids for r in out] == _greedy_reference(model, prompts, 12, eos)


@pytest.mark.slow
def test_full_sync_to_real_rollout_server_hf_backend(tiny_model_dir, tiny_tokenizer, lora_model) -> None:
    from rollout_svc.launcher import RolloutServer

    with RolloutServer.start(tiny_model_dir, backend="hf", timeout=180) as srv, ServerPool([srv.address]) as pool:
        report = WeightSyncClient(pool, lora_model, mode="auto").sync(1)  # hf backend: no LoRA -> FULL
        assert report.mode == "full" and list(report.acked) == [srv.address]
        _check_served_weights(pool, lora_model, tiny_tokenizer, 1)


@pytest.mark.vllm
@pytest.mark.slow
def test_adapter_then_full_sync_to_real_vllm_server(tiny_model_dir, tiny_tokenizer) -> None:
    """Names, dtypes and adapter_config that vLLM accepts: served greedy outputs equal the HF model
    with the adapter merged, after ADAPTER syncs, a FULL sync, and an AUTO sync after that (which must
    be FULL: the server's base weights are no longer the checkpoint's)."""
    from rollout_svc.launcher import RolloutServer

    model = _peft_model(tiny_model_dir, seed=5)

    def train_step() -> None:  # changes the adapter only
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.add_(torch.randn_like(p) * 0.5)

    with (
        RolloutServer.start(tiny_model_dir, enable_lora=True, max_lora_rank=8, dtype="float32", timeout=400) as srv,
        ServerPool([srv.address]) as pool,
    ):
        auto = WeightSyncClient(pool, model, mode="auto", fallback_to_full=False)
        assert auto.sync(1).mode == "adapter"
        _check_served_weights(pool, model, tiny_tokenizer, 1)
        train_step()
        assert auto.sync(2).mode == "adapter"  # a second adapter replaces the first
        _check_served_weights(pool, model, tiny_tokenizer, 2)
        train_step()
        assert WeightSyncClient(pool, model, mode="full").sync(3).mode == "full"
        _check_served_weights(pool, model, tiny_tokenizer, 3)
        train_step()
        fresh = WeightSyncClient(pool, model, mode="auto")  # knows only what GetStatus says
        assert fresh.sync(4).mode == "full"
        _check_served_weights(pool, model, tiny_tokenizer, 4)


@pytest.mark.vllm
@pytest.mark.slow
def test_full_sync_carries_trained_coordinate_rows_to_a_real_vllm_server(tiny_model_dir, tiny_tokenizer) -> None:
    """Issue 61: coordinate rows trained beside LoRA (peft trainable tokens, training.lora.coord_rows) reach vLLM
    merged in a FULL sync (tied head included): its greedy answers equal the HF model's with the rows, and differ
    from the checkpoint's."""
    from learner.core.vocab import VocabView
    from rollout_svc.launcher import RolloutServer

    coord = list(VocabView.from_hf_tokenizer(tiny_tokenizer).coord_token_ids)
    model = _peft_model(tiny_model_dir, seed=7, trainable_token_indices={"embed_tokens": coord})
    with torch.no_grad():  # "trained" rows: large enough that greedy decoding now writes coordinate tokens
        for n, p in model.named_parameters():
            if "trainable_tokens_delta" in n:
                p.copy_(torch.randn_like(p) * 3.0)
    prompts = _prompts(tiny_tokenizer, 6)
    eos = {tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")}
    with (
        RolloutServer.start(tiny_model_dir, enable_lora=True, max_lora_rank=8, dtype="float32", timeout=400) as srv,
        ServerPool([srv.address]) as pool,
    ):
        reqs = [RolloutRequest(token_ids=p, seed=i, request_id=f"c{i}") for i, p in enumerate(prompts)]
        before = [r.token_ids for r in RolloutClient(pool).generate(reqs, {"max_tokens": 12, "temperature": 0.0})]
        client = WeightSyncClient(pool, model, mode="auto", fallback_to_full=False)
        report = client.sync(1)
        assert report.mode == "full"  # auto: an adapter cannot carry the rows
        _check_served_weights(pool, model, tiny_tokenizer, 1)
        after = [r.token_ids for r in RolloutClient(pool).generate(reqs, {"max_tokens": 12, "temperature": 0.0})]
    assert after != before and any(t in set(coord) for a in after for t in a)
    assert after == _greedy_reference(model, prompts, 12, eos)


@pytest.mark.parametrize(("code", "outcome"), [("UNAVAILABLE", "unreachable"), ("INTERNAL", "rejected")])
def test_a_stream_broken_mid_way_does_not_hold_back_the_others(cluster, lora_model, code, outcome) -> None:
    servers, pool = cluster(3)
    servers[1].engine.abort_update_after = (3, getattr(grpc.StatusCode, code))
    client = WeightSyncClient(pool, lora_model, frame_bytes=16 << 10)  # many frames: the break is mid-way
    if outcome == "rejected":
        with pytest.raises(WeightSyncError, match="injected: stream broken"):
            client.sync(1)
    else:
        report = client.sync(1)
        assert list(report.unreachable) == [servers[1].address]
    ref = _merged_reference(lora_model)
    for s in (servers[0], servers[2]):  # got the whole stream, verified, applied
        (upd,) = s.engine.updates
        _assert_same_tensors(upd.tensors, ref)
    assert not servers[1].engine.updates and servers[1].engine.version == 0
