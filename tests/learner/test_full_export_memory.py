"""The FULL weight sync streams the merged model layer by layer: the memory it holds on the training
device stays at one LoRA layer's worth during a whole sync, instead of a merged copy of every
LoRA-targeted weight at once, and nothing is left behind afterwards.

Measured with `AllocationTracker` (a torch dispatch mode: every tensor storage created while the
export runs, including peft's merge/unmerge temporaries and the encoder's, counted until it is
freed). The export runs on the sync's fan-out thread, so the tracker is entered there, around the
export's iterator. Per LoRA layer the export holds the saved base weight and the merged copy (in
the wire dtype), and peft's unmerge computes the delta B @ A and its scaled copy next to them: 4
times the layer's weight at most (3.5 when cast to bf16 from fp32), whatever the depth of the
model.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from alloc_tracker import AllocationTracker
from learner_fakes import FakeEngine, FakeServer

import learner.sync.client as sync_client
from learner.rollouts.pool import ServerPool
from learner.sync.client import WeightSyncClient
from learner.sync.weights import full_export, full_named_tensors

KIB = 1 << 10
SLACK = 64 * KIB  # norms, biases and other small tensors that may be alive next to a layer


def _model(layers: int = 12, hidden: int = 256, dora: bool = False):
    """A random Qwen2 deep enough that a copy of every merged weight dwarfs one layer's."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=1200,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        head_dim=64,
        tie_word_embeddings=True,
    )
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "o_proj", "up_proj"],
        init_lora_weights=False,
        use_dora=dora,
    )
    return get_peft_model(Qwen2ForCausalLM(cfg), lora)


def _lora_weights(model) -> list[torch.Tensor]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m.get_base_layer().weight for m in model.modules() if isinstance(m, BaseTunerLayer)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Tracked:
    """`full_export` whose iteration runs under `tracker`, in whichever thread iterates it."""

    def __init__(self, export, tracker: AllocationTracker) -> None:
        self.export, self.tracker, self.specs = export, tracker, export.specs

    def __iter__(self):
        with self.tracker:
            yield from self.export


@pytest.fixture
def tracked_sync(monkeypatch):
    trackers: list[AllocationTracker] = []

    def tracked_full_export(*args, **kwargs):
        trackers.append(AllocationTracker())
        return _Tracked(full_export(*args, **kwargs), trackers[-1])

    monkeypatch.setattr(sync_client, "full_export", tracked_full_export)
    return trackers


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["as-trained", "bf16"])
def test_full_sync_holds_one_lora_layer_not_the_merged_model(tracked_sync, dtype) -> None:
    model = _model()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    largest = max(_nbytes(w) for w in _lora_weights(model))
    all_merged = sum(_nbytes(w) for w in _lora_weights(model))
    assert all_merged > 20 * largest  # deep enough for the difference to be unmistakable

    servers = [FakeServer(FakeEngine(ordinal=i)) for i in range(2)]
    try:
        with ServerPool([s.address for s in servers]) as pool:
            client = WeightSyncClient(pool, model, frame_bytes=64 * KIB, dtype=dtype)
            report = client.sync(1)
        (tracker,) = tracked_sync
        assert sorted(report.acked) == sorted(s.address for s in servers)
        for s in servers:  # the stream is still the merged model, bit for bit
            (upd,) = s.engine.updates
            for name, t in upd.tensors.items():
                want = reference[name] if dtype is None else reference[name].to(dtype)
                assert t.dtype == want.dtype and torch.equal(t, want), name
    finally:
        for s in servers:
            s.stop()

    # The bound: saved base + merged copy + peft's two delta temporaries, of the largest layer.
    assert tracker.peak <= 4 * largest + SLACK, (tracker.peak, largest)
    assert tracker.peak < all_merged / 4
    gc.collect()
    assert tracker.live_bytes() == 0  # no copy outlives the sync
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # bit-identical
    assert {k: v.data_ptr() for k, v in after.items()} == ptrs  # and in their own storage
    assert not any(getattr(m, "merged", False) for m in model.modules())


def test_the_old_way_held_every_merged_weight_at_once() -> None:
    """The comparison: a list of the export (what the sync built before streaming) holds a merged
    copy of every LoRA-targeted weight."""
    model = _model()
    all_merged = sum(_nbytes(w) for w in _lora_weights(model))
    listed, streamed = AllocationTracker(), AllocationTracker()
    with listed:
        items = full_named_tensors(model)
    with streamed:
        for _, t in full_export(model):
            del t
    assert listed.peak >= all_merged and listed.live_bytes() >= all_merged
    del items
    assert streamed.peak * 4 < listed.peak


def test_dora_export_is_bounded_and_keeps_the_parameters_storage() -> None:
    """DoRA merges and unmerges by swapping new tensors into the base weight; the export puts the
    parameter's own storage back, so nothing accumulates layer after layer (peft's DoRA merge needs
    more temporaries than plain LoRA: weight norms, the rescaled weight)."""
    model = _model(dora=True)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    largest = max(_nbytes(w) for w in _lora_weights(model))
    tracker = AllocationTracker()
    with tracker:
        for _, t in full_export(model):
            del t
    assert tracker.peak <= 6 * largest + SLACK, (tracker.peak, largest)
    gc.collect()
    assert tracker.live_bytes() == 0
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs


def test_header_comes_from_metadata_without_merging(monkeypatch) -> None:
    """Planning the stream (names, dtypes, shapes, total bytes) merges nothing and allocates nothing."""
    from peft.tuners.lora import Linear

    model = _model(layers=2)
    merges = []
    real_merge = Linear.merge
    monkeypatch.setattr(Linear, "merge", lambda self, *a, **k: (merges.append(self), real_merge(self, *a, **k)))
    tracker = AllocationTracker()
    with tracker:
        export = full_export(model, dtype=torch.bfloat16)
    assert merges == [] and tracker.allocated == 0
    next(n for n, _ in export if "q_proj" in n)  # iterating is what merges
    assert len(merges) == 1
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    reference.pop("lm_head.weight")  # tied: sent once, as the embedding
    assert [n for n, _ in export.specs] == list(reference)
    assert export.total_bytes == sum(t.numel() * 2 for t in reference.values())
    assert all(s.dtype == "BF16" and s.shape == tuple(reference[n].shape) for n, s in export.specs)


def test_a_stream_abandoned_half_way_leaves_the_model_as_it_was() -> None:
    model = _model(layers=2)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    it = iter(full_export(model))
    for _ in range(5):  # into the first layer's LoRA weights
        next(it)
    it.close()
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert not any(getattr(m, "merged", False) for m in model.modules())


def test_a_sync_broken_off_mid_stream_leaves_the_model_alone_once_it_returns(monkeypatch) -> None:
    """Every server breaks the stream a few LoRA layers in (after the embedding's 75 frames): the
    sync returns with the error, the fan-out thread is stopped first, and no merge touches the
    model after that."""
    import time

    import grpc
    from peft.tuners.lora import Linear

    from learner.sync.client import WeightSyncError

    model = _model(layers=4)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    merges: list[float] = []
    real_merge = Linear.merge

    def counted(self, *args, **kwargs):
        merges.append(time.monotonic())
        return real_merge(self, *args, **kwargs)

    monkeypatch.setattr(Linear, "merge", counted)
    servers = [FakeServer(FakeEngine(ordinal=i, abort_update_after=(120, grpc.StatusCode.INTERNAL))) for i in range(2)]
    try:
        with ServerPool([s.address for s in servers]) as pool:
            client = WeightSyncClient(pool, model, frame_bytes=16 * KIB)
            with pytest.raises(WeightSyncError, match="injected: stream broken"):
                client.sync(1)
            returned = time.monotonic()
    finally:
        for s in servers:
            s.stop()
    time.sleep(0.3)  # a producer left running would go on merging layers now
    assert 0 < len(merges) < 16 and all(t <= returned for t in merges)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert not any(getattr(m, "merged", False) for m in model.modules())
