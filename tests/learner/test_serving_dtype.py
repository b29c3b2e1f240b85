"""FULL weights travel in the servers' serving dtype (`spec.model.dtype`, `auto` = the checkpoint's),
not the training dtype, and the rollout server accepts exactly the dtype it serves in (`--dtype`).

The server end runs the real `RolloutServicer` with the HF engine behind a real gRPC server in this
process (registered like `rmsft serve` does it), so no vLLM and no subprocess is needed.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_servers import InProcessServer
from learner_fakes import FakeEngine, FakeServer

from learner.rollouts.pool import ServerPool
from learner.sync.client import WeightSyncClient, WeightSyncError
from learner.sync.weights import checkpoint_dtype, full_export, serving_dtype

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj"]


@pytest.fixture(scope="module")
def fp32_lora(tiny_model_dir: Path):
    """The tiny model trained in float32 (its checkpoint's dtype), with a random LoRA adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))


def _merged(model) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model).merge_and_unload().state_dict()
    ref.pop("lm_head.weight")  # tied: the checkpoint and the stream carry only the embedding
    return ref


def _with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# -- resolving the serving dtype ------------------------------------------------------------------
def test_auto_is_the_checkpoint_dtype_from_config_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert checkpoint_dtype(tiny_model_dir) == "float32"  # "dtype": "float32"
    assert serving_dtype("auto", tiny_model_dir) is torch.float32
    old_key = _with_config(tiny_model_dir, tmp_path / "old", dtype=None, torch_dtype="bfloat16")
    assert serving_dtype("auto", old_key) is torch.bfloat16  # transformers < 4.56 wrote torch_dtype
    vlm = _with_config(tiny_model_dir, tmp_path / "vlm", dtype=None, text_config={"dtype": "float16"})
    assert serving_dtype("auto", vlm) is torch.float16
    # no dtype in config.json: the floating dtype of (most of) the stored tensors
    bare = _with_config(tiny_model_dir, tmp_path / "bare", dtype=None)
    assert checkpoint_dtype(bare) == "float32"


def test_explicit_dtypes_and_errors(tiny_model_dir: Path) -> None:
    assert serving_dtype("bfloat16") is torch.bfloat16
    assert serving_dtype("float16", tiny_model_dir) is torch.float16
    assert serving_dtype(torch.float32) is torch.float32
    assert serving_dtype(None) is None  # no cast: as trained
    with pytest.raises(ValueError, match="checkpoint folder"):
        serving_dtype("auto")
    with pytest.raises(ValueError, match="'auto' or one of"):
        serving_dtype("fp8")


def test_export_casts_floating_tensors_once_and_keeps_names(fp32_lora) -> None:
    export = full_export(fp32_lora, dtype=torch.bfloat16)
    items = list(export)
    ref = _merged(fp32_lora)
    assert [n for n, _ in items] == list(ref)
    for name, t in items:
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref[name].to(torch.bfloat16)), name
    assert export.total_bytes == sum(t.numel() * 2 for t in ref.values())


# -- the learner sends the serving dtype ----------------------------------------------------------
def test_bf16_serving_sends_half_the_bytes_of_fp32(fp32_lora, tiny_model_dir: Path) -> None:
    server = FakeServer(FakeEngine())
    try:
        with ServerPool([server.address]) as pool:
            fp32 = WeightSyncClient(pool, fp32_lora, dtype="auto", checkpoint_dir=tiny_model_dir).sync(1)
            bf16 = WeightSyncClient(pool, fp32_lora, dtype="bfloat16").sync(2)
    finally:
        server.stop()
    ref = _merged(fp32_lora)
    assert fp32.tensor_bytes == sum(t.numel() * 4 for t in ref.values())
    assert bf16.tensor_bytes * 2 == fp32.tensor_bytes
    first, second = server.engine.updates
    assert first.header.total_bytes == fp32.tensor_bytes and second.header.total_bytes == bf16.tensor_bytes
    assert {t.dtype for t in first.tensors.values()} == {torch.float32}
    assert {t.dtype for t in second.tensors.values()} == {torch.bfloat16}
    assert all(torch.equal(second.tensors[n], t.to(torch.bfloat16)) for n, t in ref.items())


# -- the rollout server accepts the dtype it serves in --------------------------------------------
@pytest.fixture
def hf_server(tiny_model_dir: Path, tmp_path: Path):
    made: list[InProcessServer] = []

    def start(dtype: str) -> InProcessServer:
        made.append(InProcessServer(tiny_model_dir, tmp_path / f"stage-{len(made)}", dtype=dtype))
        return made[-1]

    yield start
    for s in made:
        s.close()


def test_bf16_server_accepts_and_applies_bf16_from_an_fp32_learner(hf_server, fp32_lora) -> None:
    srv = hf_server("bfloat16")
    with ServerPool([srv.address]) as pool:
        report = WeightSyncClient(pool, fp32_lora, dtype="bfloat16").sync(1)
        assert list(report.acked) == [srv.address]
        reply = report.acked[srv.address]
        assert reply.version == 1 and reply.bytes_received == report.tensor_bytes
        assert pool.status(pool.servers[0]).weight_version == 1
    ref = _merged(fp32_lora)
    assert report.tensor_bytes == sum(t.numel() * 2 for t in ref.values())
    # what the engine now holds is the merged model rounded to bf16 (the HF engine keeps its own
    # parameter dtype and copies the received values into it)
    served = dict(srv.engine.hf.named_parameters())
    for name, want in ref.items():
        got = served[name]
        assert torch.equal(got, want.to(torch.bfloat16).to(got.dtype)), name


def test_server_rejects_a_dtype_it_does_not_serve_with_a_clear_error(hf_server, fp32_lora, tiny_model_dir) -> None:
    bf16 = hf_server("bfloat16")
    auto = hf_server("auto")  # the tiny checkpoint is float32
    with ServerPool([bf16.address]) as pool:
        with pytest.raises(
            WeightSyncError,
            match=r"INVALID_ARGUMENT.*dtype F32, the model expects BF16: this "
            r"server serves bfloat16 \(--dtype bfloat16\)",
        ):
            WeightSyncClient(pool, fp32_lora, dtype="float32").sync(1)
        assert pool.status(pool.servers[0]).weight_version == 0  # nothing applied
    with ServerPool([auto.address]) as pool:
        with pytest.raises(WeightSyncError, match=r"serves float32 \(--dtype auto: the checkpoint's dtype\)"):
            WeightSyncClient(pool, fp32_lora, dtype="bfloat16").sync(1)
        # the same job with model.dtype auto: the learner resolves it the way the server does
        assert WeightSyncClient(pool, fp32_lora, dtype="auto", checkpoint_dir=tiny_model_dir).sync(2).acked
