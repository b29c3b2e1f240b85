"""ADAPTER sync to a vLLM server started without LoRA: refused with FAILED_PRECONDITION, nothing
changes. A module of its own so its engine starts after test_rollout_vllm.py's has stopped (two
vLLM engines at once would crowd this 2-core machine)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from rollout_svc_helpers import generate, hf_greedy, hf_model, lora_adapter, prompt_ids, status

from rmsft.weight_wire import ADAPTER, encode_weight_stream, update_weights_raw
from rollout_svc.launcher import RolloutServer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def plain_srv(tiny_model_dir: Path):
    with RolloutServer.start(tiny_model_dir, dtype="float32", timeout=400) as s:
        yield s


def test_adapter_on_vllm_without_lora_is_refused(plain_srv, tiny_model_dir, tiny_tokenizer, tmp_path) -> None:
    base = hf_model(tiny_model_dir)
    prompts = prompt_ids(tiny_tokenizer)
    expected = hf_greedy(base, prompts, 16, tiny_tokenizer.eos_token_id)
    st = status(plain_srv)
    assert st.backend == "vllm" and not st.lora_enabled and st.weight_version == 0

    tensors, cfg_json, _ = lora_adapter(base, 3, tmp_path)
    _, requests = encode_weight_stream(tensors, number=1, mode=ADAPTER, adapter_config_json=cfg_json)
    with grpc.insecure_channel(plain_srv.address) as channel, pytest.raises(grpc.RpcError) as info:
        update_weights_raw(channel)(requests, metadata=plain_srv.metadata(), timeout=60)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enable-lora" in info.value.details()

    after = status(plain_srv)
    assert after.weight_version == 0 and after.ready and plain_srv.health() == "SERVING"
    resp = generate(plain_srv.stub(), plain_srv.metadata(), prompts)
    assert resp.weight_version == 0
    assert [list(c.token_ids) for c in resp.completions] == expected
