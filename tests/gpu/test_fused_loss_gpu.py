"""training.loss.logits fused (liger-kernel's fused linear cross-entropy for the CE term and GRPO's log-probs,
learner/core/fused.py) = chunked on CUDA: loss, every term and every gradient, both recipe generations, GRPO at
temperature 1 (the kernel) and another (the chunked fallback), and the coordinate rows peft trains under LoRA
(the kernel takes their merged weight). Skipped, saying why, without CUDA or without liger-kernel (the GPU image
and `make gpu-check`'s wheels bring it); the selection and its refusals are tested on the CPU
(tests/core/test_core_fused_select.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
    pytest.mark.skipif(
        importlib.util.find_spec("liger_kernel") is None,
        reason="needs liger-kernel (the GPU image's `fused` extra; make gpu-check-wheels brings it)",
    ),
]

DEVICE = "cuda"


def _prompt(tok, i):
    msgs = [{"role": "user", "content": f"Image {i}: detect every object."}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]


def _row(tok, vocab, generation: int):
    """A packed row of several segments: generation 1 (matched, missed objects) or 2 (a duplicate's unlikelihood,
    a recovered object's weights, boxes): every loss term present."""
    from learner.core.clean_prefix import CleanPrefixConfig, DuplicateConfig, build_clean_targets, find_duplicates
    from learner.core.codec import COORDEXP, DetObject
    from learner.core.match import MatchConfig, match
    from learner.core.packing import pack
    from learner.core.parse import parse
    from learner.core.targets import build_targets

    cat, dog = DetObject("cat", "bbox_2d", (100, 100, 300, 300)), DetObject("dog", "bbox_2d", (500, 500, 700, 700))
    bird = DetObject("bird", "bbox_2d", (10, 600, 90, 900))
    segs = []
    if generation == 1:
        for i, (pred, gt) in enumerate([([cat, bird], [cat, dog, bird]), ([], [dog])]):
            parsed = parse(list(vocab.encode(COORDEXP.render(pred))) + [vocab.eos_id], vocab)
            m = match([o.obj for o in parsed.objects], gt)
            segs.append(build_targets(_prompt(tok, i), parsed, m, gt, vocab, rollout_prompt_ids=_prompt(tok, i)))
    else:
        for i, (pred, gt, rec) in enumerate([([cat, cat, bird], [cat, dog], {1}), ([dog], [dog, bird, cat], {2})]):
            parsed = parse(list(vocab.encode(COORDEXP.render(pred))) + [vocab.eos_id], vocab)
            objs = [o.obj for o in parsed.objects]
            dups = find_duplicates(objs, DuplicateConfig())
            m = match(
                [o for j, o in enumerate(objs) if j not in dups],
                gt,
                MatchConfig(iou_gate=0.5, fp_cost=1.0, fn_cost=1.2),
            )
            segs.append(
                build_clean_targets(
                    _prompt(tok, i), parsed, dups, m, gt, vocab, COORDEXP, cfg=CleanPrefixConfig(), recovered=rec
                )
            )
    return pack(segs, packing_length=4096)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, row, mode, loss_of):
    from learner.core.head import row_outputs

    model.zero_grad()
    source = row_outputs(model, model, row.model_inputs(), mode, 7)
    assert source.fused == (mode == "fused")  # the kernel ran where it was asked for, not the fallback
    out = loss_of(source)
    out.loss.backward()
    return out, _grads(model)


def _assert_same(fused, chunked, keys, rtol: float = 1e-5, grad_rtol: float = 1e-3):
    (f_out, f_grads), (c_out, c_grads) = fused, chunked
    assert c_out.loss.item() != 0
    assert abs(f_out.loss.item() - c_out.loss.item()) <= rtol * max(1.0, abs(c_out.loss.item()))
    parts_f, parts_c = (o.parts if hasattr(o, "parts") else o.metrics for o in (f_out, c_out))
    for k in keys:
        assert torch.allclose(parts_f[k], parts_c[k], rtol=rtol, atol=1e-6), k
    assert f_grads.keys() == c_grads.keys() and f_grads
    # The kernel sums fp32 in its own order (as the chunked path's fewer-row GEMMs do); a missing, doubled or
    # unweighted term is of the order of the gradient itself.
    for n in c_grads:
        scale = float(c_grads[n].abs().max())
        assert float((f_grads[n] - c_grads[n]).abs().max()) <= grad_rtol * scale, n


@pytest.fixture(scope="module")
def tiny_vocab(tiny_tokenizer):
    from learner.core.vocab import VocabView

    return VocabView.from_hf_tokenizer(tiny_tokenizer)


@pytest.fixture(scope="module")
def cuda_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.to(DEVICE).eval()


@pytest.mark.parametrize("generation", [1, 2])
def test_fused_loss_equals_chunked_on_cuda(cuda_model, tiny_tokenizer, tiny_vocab, generation: int) -> None:
    from learner.core.losses import LossWeights, compute_loss

    row = _row(tiny_tokenizer, tiny_vocab, generation).to(DEVICE)
    if generation == 2:  # the per-token CE weights the kernel's reduction "none" must honour are in the row
        assert row.ce_weights is not None and bool((row.ce_weights != 1).any()) and row.n_unlikelihood
    w = (
        LossWeights(ce=1.0, soft_ce=0.7, w1=1.3, gate=0.5)
        if generation == 1
        else LossWeights(
            ce=1.0,
            soft_ce=0.1,
            w1=0.02,
            gate=1.0,
            coord_ce=0.02,
            smooth_l1=1.0,
            ciou=0.5,
            unlikelihood=1.0,
            weighted_mean=True,
        )
    )

    def loss_of(source):
        return compute_loss(source, row, tiny_vocab.coord_token_ids, w)

    keys = ("ce", "soft_ce", "w1", "gate", "coord", "geo", "ul")
    _assert_same(_run(cuda_model, row, "fused", loss_of), _run(cuda_model, row, "chunked", loss_of), keys)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_grpo_equals_chunked_on_cuda(cuda_model, temperature: float) -> None:
    from learner.core.grpo import GrpoConfig, completion_logprobs, grpo_loss, grpo_segment
    from learner.core.head import row_outputs
    from learner.core.packing import pack

    cfg = GrpoConfig(kl_coef=0.1, temperature=temperature)
    g = torch.Generator().manual_seed(1)
    segs = []
    for i, (p, c) in enumerate([(9, 11), (5, 23), (14, 3)]):
        prompt, completion = torch.randint(3, 200, (p,), generator=g).tolist(), torch.randint(3, 200, (c,), generator=g)
        segs.append(
            grpo_segment(prompt, completion.tolist(), (-torch.rand(c, generator=g) * 3).tolist(), [0.8, -1.1, 0.3][i])
        )
    row = pack(segs, packing_length=256).to(DEVICE)
    with torch.no_grad():  # the reference policy's log-probs both ways
        refs = [
            completion_logprobs(row_outputs(cuda_model, cuda_model, row.model_inputs(), mode, 4), row, temperature)
            for mode in ("fused", "chunked")
        ]
    assert torch.allclose(refs[0], refs[1], rtol=1e-5, atol=1e-5)
    fused = _run(cuda_model, row, "fused", lambda s: grpo_loss(s, row, cfg, refs[1]))
    chunked = _run(cuda_model, row, "chunked", lambda s: grpo_loss(s, row, cfg, refs[1]))
    _assert_same(fused, chunked, ("clip_fraction", "ratio_mean", "kl"))


def test_fused_loss_trains_the_coordinate_rows_as_chunked_under_lora(
    tiny_model_dir: Path, tiny_tokenizer, tiny_vocab
) -> None:
    """finetune: lora with its coordinate rows (peft's trainable token rows on the tied head): the kernel takes
    their merged weight, so their delta's gradient is chunked's."""
    from learner.core.losses import LossWeights, compute_loss
    from learner.train.policy import load_policy
    from rmsft.jobspec import TrainingConfig

    cfg = TrainingConfig.model_validate({"data": {"path": "x.jsonl"}, "finetune": "lora"})
    model = load_policy(tiny_model_dir, cfg).model.to(DEVICE)
    with torch.no_grad():  # rows that differ from their base, as after some steps
        for n, p in model.named_parameters():
            if "trainable_tokens_delta" in n:
                p.add_(0.05 * torch.randn_like(p))
    row = _row(tiny_tokenizer, tiny_vocab, 1).to(DEVICE)

    def loss_of(source):
        return compute_loss(source, row, tiny_vocab.coord_token_ids, LossWeights())

    fused, chunked = _run(model, row, "fused", loss_of), _run(model, row, "chunked", loss_of)
    assert any("trainable_tokens_delta" in n for n in chunked[1])
    _assert_same(fused, chunked, ("ce", "coord"))


def test_fused_bf16_loss_is_chunked_within_bf16(cuda_model, tiny_tokenizer, tiny_vocab) -> None:
    """Under bf16 autocast (training.precision bf16) the kernel's GEMM is bf16 like the head's: the same loss to
    bf16's rounding."""
    from learner.core.losses import compute_loss

    row = _row(tiny_tokenizer, tiny_vocab, 1).to(DEVICE)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outs = [
            _run(cuda_model, row, mode, lambda s: compute_loss(s, row, tiny_vocab.coord_token_ids))
            for mode in ("fused", "chunked")
        ]
    _assert_same(outs[0], outs[1], ("ce",), rtol=2e-2, grad_rtol=5e-2)
