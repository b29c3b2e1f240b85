"""The chunked loss (spec.training.loss.logits: chunked) equals the full-logits loss, term by term and in its
gradients: both recipe generations and GRPO's log-probs, on the tiny model; and it never makes more than one chunk
of logits at a time."""

from __future__ import annotations

import pytest
import torch

from learner.core.clean_prefix import CleanPrefixConfig, DuplicateConfig, build_clean_targets, find_duplicates
from learner.core.codec import COORDEXP, DetObject
from learner.core.grpo import GrpoConfig, completion_logprobs, grpo_loss, grpo_segment
from learner.core.head import RowHead, row_outputs
from learner.core.losses import LossWeights, compute_loss
from learner.core.match import MatchConfig, match
from learner.core.packing import pack
from learner.core.parse import parse
from learner.core.targets import build_targets

CAT = DetObject("cat", "bbox_2d", (100, 100, 300, 300))
DOG = DetObject("dog", "bbox_2d", (500, 500, 700, 700))
BIRD = DetObject("bird", "bbox_2d", (10, 600, 90, 900))
CAR = DetObject("red car", "poly", (10, 600, 400, 990, 200, 700))

FIRST = LossWeights(ce=1.0, soft_ce=0.7, w1=1.3, gate=0.5, sigma=2.0)
SECOND = LossWeights(
    ce=1.0, soft_ce=0.1, w1=0.02, gate=1.0, coord_ce=0.02, smooth_l1=1.0, ciou=0.5, unlikelihood=1.0, weighted_mean=True
)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def _prompt(tok, i):
    msgs = [{"role": "user", "content": f"Image {i}: detect every object."}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]


def _first_generation(tok, vocab):
    segs = []
    for i, (pred, gt) in enumerate([([CAT, BIRD], [CAT, DOG, BIRD]), ([], [CAR]), ([DOG, CAR], [DOG, CAT])]):
        ids = list(vocab.encode(COORDEXP.render(pred))) + [vocab.eos_id]
        parsed = parse(ids, vocab)
        m = match([o.obj for o in parsed.objects], gt)
        segs.append(build_targets(_prompt(tok, i), parsed, m, gt, vocab, rollout_prompt_ids=_prompt(tok, i)))
    return segs


def _second_generation(tok, vocab):
    """Channel-B segments with every extra: a duplicate (unlikelihood), a recovered object (weights), boxes."""
    segs = []
    for i, (pred, gt, recovered) in enumerate([([CAT, CAT, BIRD], [CAT, DOG], {1}), ([DOG], [DOG, BIRD, CAT], {2})]):
        ids = list(vocab.encode(COORDEXP.render(pred))) + [vocab.eos_id]
        parsed = parse(ids, vocab)
        objs = [o.obj for o in parsed.objects]
        dups = find_duplicates(objs, DuplicateConfig())
        kept = [o for j, o in enumerate(objs) if j not in dups]
        m = match(kept, gt, MatchConfig(iou_gate=0.5, fp_cost=1.0, fn_cost=1.2))
        segs.append(
            build_clean_targets(
                _prompt(tok, i), parsed, dups, m, gt, vocab, COORDEXP, cfg=CleanPrefixConfig(), recovered=recovered
            )
        )
    return segs


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss_and_grads(model, row, mode, chunk, loss_of):
    model.zero_grad()
    out = loss_of(row_outputs(model, model, row.model_inputs(), mode, chunk))
    out.loss.backward()
    return out, _grads(model)


def _assert_same(full, chunked, keys):
    (f_out, f_grads), (c_out, c_grads) = full, chunked
    assert f_out.loss.item() > 0
    assert abs(f_out.loss.item() - c_out.loss.item()) <= 1e-6 * max(1.0, abs(f_out.loss.item()))
    parts_f, parts_c = (o.parts if hasattr(o, "parts") else o.metrics for o in (f_out, c_out))
    for k in keys:
        assert torch.allclose(parts_f[k], parts_c[k], rtol=1e-6, atol=1e-7), k
    assert f_grads.keys() == c_grads.keys() and f_grads
    # fp32 sums in another order: the full path is itself this far from an fp64 run (second generation, whose
    # gradient cancels the most: full 2e-5, chunked 1e-4 of the largest entry); a missing or doubled term is ~1.
    for n in f_grads:
        scale = float(f_grads[n].abs().max())
        assert float((f_grads[n] - c_grads[n]).abs().max()) <= 5e-4 * scale, n


@pytest.mark.parametrize("generation", [1, 2])
def test_chunked_loss_equals_full_loss_and_gradients(tiny_model, tiny_tokenizer, tiny_vocab, generation):
    segs = (_first_generation if generation == 1 else _second_generation)(tiny_tokenizer, tiny_vocab)
    row = pack(segs, packing_length=4096)
    w = FIRST if generation == 1 else SECOND
    if generation == 2:  # every term of the second generation is in the row
        assert row.n_unlikelihood and row.n_boxes and row.coord_weights is not None and row.ce_weights is not None
    coord_ids = tiny_vocab.coord_token_ids

    def loss_of(logits):
        return compute_loss(logits, row, coord_ids, w)

    full = _loss_and_grads(tiny_model, row, "full", 0, loss_of)
    keys = ("ce", "soft_ce", "w1", "gate", "coord", "geo", "ul")
    if generation == 2:
        assert float(full[0].parts["geo"]) > 0 and float(full[0].parts["ul"]) > 0
    # Chunks of 7 positions (several per term, the last one short) and one chunk holding everything.
    for chunk in (7, 100_000):
        _assert_same(full, _loss_and_grads(tiny_model, row, "chunked", chunk, loss_of), keys)


@pytest.mark.parametrize("cfg", [GrpoConfig(), GrpoConfig(kl_coef=0.1, temperature=0.7, loss_norm="sequence")])
def test_chunked_grpo_equals_full(tiny_model, cfg):
    torch.manual_seed(1)
    segs = []
    for i, (p, c) in enumerate([(9, 11), (5, 23), (14, 3)]):
        prompt, completion = torch.randint(3, 200, (p,)).tolist(), torch.randint(3, 200, (c,)).tolist()
        old = (-torch.rand(c) * 3).tolist()
        segs.append(grpo_segment(prompt, completion, old, [0.8, -1.1, 0.3][i]))
    row = pack(segs, packing_length=256)
    with torch.no_grad():  # the reference policy's log-probs (here the same weights), both ways
        ref_full = completion_logprobs(
            row_outputs(tiny_model, tiny_model, row.model_inputs(), "full"), row, cfg.temperature
        )
        ref_chunked = completion_logprobs(
            row_outputs(tiny_model, tiny_model, row.model_inputs(), "chunked", 4), row, cfg.temperature
        )
    assert torch.allclose(ref_full, ref_chunked, rtol=1e-6, atol=1e-6)
    ref = ref_full if cfg.kl_coef > 0 else None
    full = _loss_and_grads(tiny_model, row, "full", 0, lambda lg: grpo_loss(lg, row, cfg, ref))
    chunked = _loss_and_grads(tiny_model, row, "chunked", 4, lambda lg: grpo_loss(lg, row, cfg, ref))
    _assert_same(full, chunked, ("clip_fraction", "ratio_mean", "kl"))


def test_chunked_path_makes_one_chunk_of_logits_at_a_time(tiny_model, tiny_tokenizer, tiny_vocab):
    """The model is asked for no logits; the head runs on at most `chunk` target positions per call, in the forward
    and in the backward's recompute, and never on the prompt's positions."""
    row = pack(_first_generation(tiny_tokenizer, tiny_vocab), packing_length=4096)
    calls = []
    hook = tiny_model.lm_head.register_forward_hook(lambda _m, a, out: calls.append(tuple(out.shape)))
    try:
        out = row_outputs(tiny_model, tiny_model, row.model_inputs(), "chunked", 16)
        assert isinstance(out, RowHead) and out.length == row.length
        assert calls == [(1, 0, tiny_model.config.vocab_size)]  # the model's own head: 0 positions
        calls.clear()
        tiny_model.zero_grad()
        compute_loss(out, row, tiny_vocab.coord_token_ids, FIRST).loss.backward()
    finally:
        hook.remove()
    rows = [c[0] for c in calls]
    targets = len(row.ce_positions) + len(row.coord_positions)
    assert max(rows) <= 16 and sum(rows) == 2 * targets  # forward + recompute, target positions only
    assert targets < row.length / 2  # the prompts' positions (most of the row) got no logits


def test_unknown_mode_is_refused(tiny_model, tiny_tokenizer, tiny_vocab):
    row = pack(_first_generation(tiny_tokenizer, tiny_vocab)[:1])
    with pytest.raises(ValueError, match="loss.logits must be one of"):
        row_outputs(tiny_model, tiny_model, row.model_inputs(), "sparse")


def test_vision_language_models_give_the_head_their_final_hidden_states(tiny_vl_model_dir):
    """Qwen3-VL and Qwen2.5-VL (the models users bring): the decoder the chunked path reads is the text model,
    whose output through the head is the model's own logits."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_model_dir, dtype=torch.float32).eval()
    ids = torch.randint(5, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = row_outputs(model, model, {"input_ids": ids}, "full")[0]
        head = row_outputs(model, model, {"input_ids": ids}, "chunked", 7)
        (rows,) = head.map(torch.arange(40), lambda lg: (lg,))
    assert rows.shape == full.shape and torch.allclose(rows, full, rtol=1e-6, atol=1e-6)
