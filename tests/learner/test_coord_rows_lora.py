"""Issue 61: under LoRA the coordinate tokens' embedding rows train (training.lora.coord_rows, peft trainable
tokens; on by default with a coordinate-token format); a FULL sync and the export carry them merged, once for a
tied head; an adapter sync cannot carry them and says so."""

from __future__ import annotations

import pytest
import torch


def _policy(model_dir, **lora):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.train.policy import policy_from_model
    from rmsft.jobspec import TrainingConfig

    torch.manual_seed(0)
    cfg = TrainingConfig(
        data={"path": "d.jsonl"}, finetune="lora", lora={"r": 4, "target_modules": ["q_proj", "v_proj"], **lora}
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return policy_from_model(model, AutoTokenizer.from_pretrained(model_dir), cfg)


def _one_step(policy):
    """One AdamW step on a loss that reads coordinate tokens (in the input) and their logits (tied head)."""
    model, coord = policy.model, list(policy.vocab.coord_token_ids)
    ids = torch.tensor([[*policy.vocab.encode("box: "), *coord[100:140]]])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    logits = model(input_ids=ids).logits
    loss = -torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).mean()
    loss.backward()
    opt.step()


def _embedding(tensors):
    return next(t for n, t in tensors if n.endswith("embed_tokens.weight"))


def test_coordinate_rows_train_under_lora_and_the_full_export_carries_them_merged(tiny_model_dir):
    from learner.sync.weights import adapter_unsupported_reason, changed_keys, full_named_tensors

    policy = _policy(tiny_model_dir)  # coord_rows unset, format coordexp: on
    coord = torch.tensor(policy.vocab.coord_token_ids)
    trained = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert any("trainable_tokens_delta" in n for n in trained)
    before = _embedding(full_named_tensors(policy.model)).clone()
    _one_step(policy)
    export = full_named_tensors(policy.model)
    names = [n for n, _ in export]
    assert len(names) == len(set(names)) and not any("token_adapter" in n or "trainable_tokens" in n for n in names)
    assert "lm_head.weight" not in names  # tied: sent once, as save_pretrained writes it
    after = _embedding(export)
    moved = (after[coord] - before[coord]).abs().amax(dim=1)
    assert bool((moved[100:140] > 0).all())  # the rows the step read moved
    others = torch.ones(after.shape[0], dtype=torch.bool)
    others[coord] = False
    assert torch.equal(after[others], before[others])  # every other row is untouched (the base stays frozen)
    # The export is what the trained model computes with: its embedding of the coordinate tokens.
    live = policy.model.get_input_embeddings()(coord[None])[0]
    assert torch.allclose(after[coord], live.detach(), atol=0, rtol=0)
    # Only what training changes is resent by a changed_only FULL sync: the embedding among it.
    assert any(k.endswith("embed_tokens.token_adapter.base_layer.weight") for k in changed_keys(policy.model))
    # A vLLM LoRA adapter cannot carry embedding rows: ADAPTER says so (and falls back to FULL).
    why = adapter_unsupported_reason(policy.model)
    assert why is not None and "training.lora.coord_rows" in why


def test_coordinate_rows_stay_frozen_when_turned_off(tiny_model_dir):
    from learner.sync.weights import adapter_unsupported_reason, full_named_tensors

    policy = _policy(tiny_model_dir, coord_rows=False)
    assert not any("trainable_tokens" in n for n, _ in policy.model.named_parameters())
    before = _embedding(full_named_tensors(policy.model)).clone()
    _one_step(policy)
    assert torch.equal(_embedding(full_named_tensors(policy.model)), before)
    assert adapter_unsupported_reason(policy.model) is None


def test_adapter_sync_names_why_it_falls_back_to_full(tiny_model_dir):
    from learner.rollouts.pool import ServerPool
    from learner.sync.client import WeightSyncClient

    policy = _policy(tiny_model_dir)
    pool = ServerPool(["127.0.0.1:1"], reprobe_interval_s=0.0)
    try:
        with pytest.raises(ValueError, match="sync mode 'adapter' is impossible: the coordinate tokens' embedding"):
            WeightSyncClient(pool, policy.model, mode="adapter", fallback_to_full=False)
        client = WeightSyncClient(pool, policy.model, mode="adapter", fallback_to_full=True)
        assert "training.lora.coord_rows" in client.forced_full_reason
    finally:
        pool.close()


def test_the_setting_is_refused_with_qwen_json():
    from rmsft.jobspec import TrainingConfig

    with pytest.raises(ValueError, match="coord_rows applies to coordinate-token formats"):
        TrainingConfig(data={"path": "d.jsonl"}, format="qwen_json", lora={"coord_rows": True})
