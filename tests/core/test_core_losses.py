"""Coordinate loss shape, and packed-row loss/gradients == the same segments run one by one."""

from __future__ import annotations

import pytest
import torch
from core_helpers import render

from learner.core.codec import NUM_BINS, DetObject
from learner.core.losses import LossWeights, compute_loss, coord_loss_terms, gaussian_targets, loss_sums
from learner.core.match import match
from learner.core.packing import pack
from learner.core.parse import parse
from learner.core.targets import IGNORE_INDEX, Segment, build_targets


def peaked(centre: torch.Tensor, width: float = 3.0, scale: float = 1.0) -> torch.Tensor:
    grid = torch.arange(NUM_BINS, dtype=torch.float32)
    return -scale * ((grid[None, :] - centre[:, None].float()) / width) ** 2


@pytest.mark.parametrize("target", [0, 1, 137, 500, 998, 999])
def test_coord_loss_is_minimal_at_target_bin(target):
    # Predictions shaped like the target distribution, centred on every bin in turn.
    centres = torch.arange(NUM_BINS)
    coord = torch.log(gaussian_targets(centres, 2.0))
    full = torch.cat([coord, torch.full((NUM_BINS, 50), -1e4)], dim=1)  # 50 non-coord logits
    soft, w1, gate = coord_loss_terms(coord, full, torch.full((NUM_BINS,), target), sigma=2.0)
    for term in (soft, w1, soft + w1 + gate):
        assert int(term.argmin()) == target
    assert float(w1[target]) < 1e-5
    # The target distribution is a stationary point of the soft CE (W1 is |.|: non-smooth there).
    q_logits = coord[target : target + 1].clone().requires_grad_(True)
    soft, _, _ = coord_loss_terms(q_logits, q_logits, torch.tensor([target]), sigma=2.0)
    soft.sum().backward()
    assert q_logits.grad.abs().max() < 1e-5


@pytest.mark.parametrize("target", [5, 137, 500, 994])
def test_peaked_prediction_is_best_at_target_bin(target):
    # Sharp (near one-hot) predictions: away from the grid borders the best one sits on the target.
    coord = peaked(torch.arange(NUM_BINS), width=1.0, scale=30.0)
    full = torch.cat([coord, torch.full((NUM_BINS, 50), -1e4)], dim=1)
    soft, w1, gate = coord_loss_terms(coord, full, torch.full((NUM_BINS,), target), sigma=2.0)
    for term in (soft, w1, soft + w1 + gate):
        assert int(term.argmin()) == target


def test_gate_penalises_mass_outside_coord_vocab():
    coord = torch.zeros(1, NUM_BINS)
    low = torch.cat([coord, torch.full((1, 10), -20.0)], dim=1)
    high = torch.cat([coord, torch.full((1, 10), 20.0)], dim=1)
    _, _, g_low = coord_loss_terms(coord, low, torch.tensor([5]), 2.0)
    _, _, g_high = coord_loss_terms(coord, high, torch.tensor([5]), 2.0)
    assert 0 <= float(g_low) < 1e-6 < float(g_high)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e4, 3e4, 1e30])
def test_extreme_logits_give_finite_gradients(dtype, magnitude):
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(4, NUM_BINS + 30, generator=g) * magnitude).to(dtype).requires_grad_(True)
    ids = list(range(NUM_BINS))
    coord = full[:, ids]
    soft, w1, gate = coord_loss_terms(coord, full, torch.tensor([0, 999, 500, 3]), 2.0)
    loss = (soft + w1 + gate).sum()
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(full.grad).all()


def test_row_without_targets_and_pooling_across_rows():
    empty = pack([Segment((5, 6, 7), (IGNORE_INDEX,) * 3, (), (), 1, 0)])
    logits = torch.randn(1, 3, NUM_BINS + 20, requires_grad=True)
    out = compute_loss(logits, empty, list(range(NUM_BINS)))
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.isfinite(logits.grad).all()
    # Rows pool by token counts: the pooled CE is the count-weighted mean, not the mean of means.
    a = pack([Segment((5, 6, 7), (IGNORE_INDEX, 6, 7), (), (), 1, 0)])
    b = pack([Segment((5, 6), (IGNORE_INDEX, 6), (), (), 1, 0)])
    la, lb = torch.randn(3, NUM_BINS + 20), torch.randn(2, NUM_BINS + 20)
    ids = list(range(NUM_BINS))
    pooled = (loss_sums(la, a, ids) + loss_sums(lb, b, ids)).finish()
    ce_a, ce_b = compute_loss(la, a, ids).parts["ce"], compute_loss(lb, b, ids).parts["ce"]
    assert pooled.loss.item() == pytest.approx((2 * ce_a.item() + ce_b.item()) / 3, rel=1e-6)


def test_plain_text_format_without_coord_tokens_is_ce_only(stock_vocab):
    """qwen_json with a vocabulary that has no coord tokens: rows carry no coord positions, the coordinate
    terms are exact zeros (no NaN from an empty coord vocabulary), and all gradient is cross-entropy's."""
    import torch.nn.functional as F

    from learner.core.codec import QWEN_JSON

    vocab = stock_vocab
    gt = [CAT, QWEN_JSON.as_written(DOG), BIRD]
    segs = []
    for pred, cut in (([CAT], None), ([DetObject("kitten", "bbox_2d", (110, 100, 300, 310)), BIRD], -4)):
        ids = list(vocab.encode(QWEN_JSON.render(pred))) + [vocab.eos_id]
        parsed = parse(ids[:cut] if cut else ids, vocab, QWEN_JSON)
        m = match([o.obj for o in parsed.objects], gt)
        segs.append(build_targets([1, 2, 3], parsed, m, gt, vocab, QWEN_JSON))
    assert all(s.coord_positions == () for s in segs)
    row = pack(segs)
    logits = (torch.randn(1, row.length, vocab.vocab_size) * 5).requires_grad_(True)
    w = LossWeights(ce=0.8, soft_ce=1.0, w1=1.0, gate=1.0)
    out = compute_loss(logits, row, (), w)
    assert int(out.parts["coord_count"]) == 0 and int(out.parts["ce_count"]) > 0
    for name in ("soft_ce", "w1", "gate", "coord"):
        assert float(out.parts[name]) == 0.0, name
    labels = row.labels[0]
    ce_pos = torch.nonzero(labels != IGNORE_INDEX).flatten()
    want = F.cross_entropy(logits.detach()[0, ce_pos - 1], labels[ce_pos])
    assert torch.isfinite(out.loss) and out.loss.item() == pytest.approx(0.8 * want.item(), rel=1e-5)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()
    touched = torch.nonzero(logits.grad[0].abs().sum(-1)).flatten()
    assert touched.tolist() == (ce_pos - 1).tolist()  # gradient only where a CE target is read
    # Coord targets with no coord token ids are a configuration error, not a silent zero.
    coord_row = pack([Segment((5, 6, 7), (IGNORE_INDEX,) * 3, (2,), (10,), 1, 0)])
    with pytest.raises(ValueError, match="coord token ids"):
        loss_sums(torch.randn(1, 3, 50), coord_row, ())


# ---- packed vs unpacked on the tiny model ------------------------------------------------------

CAT = DetObject("cat", "bbox_2d", (100, 100, 300, 300))
DOG = DetObject("dog", "poly", (500, 500, 700, 500, 600, 700))
BIRD = DetObject("bird", "bbox_2d", (800, 50, 900, 150))
CAR = DetObject("red car", "bbox_2d", (10, 600, 400, 990))


def _segments(tok, vocab):
    cases = [
        ([DetObject("kitten", "bbox_2d", (110, 100, 300, 310)), BIRD], [CAT, DOG, BIRD], None),
        ([CAR, DetObject("ghost", "bbox_2d", (0, 900, 20, 999)), DOG], [CAR, DOG, CAT], -5),
        ([], [BIRD], None),
        ([DetObject("dog", "poly", (510, 500, 690, 510, 600, 690)), CAT], [DOG, CAT, CAR], -9),
    ]
    segs = []
    for i, (pred, gt, cut) in enumerate(cases):
        msgs = [{"role": "user", "content": f"Image {i}: detect every object and answer in JSON."}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
        ids = list(vocab.encode(render(pred))) + [vocab.eos_id]
        parsed = parse(ids[:cut] if cut else ids, vocab)
        m = match([o.obj for o in parsed.objects], gt)
        segs.append(build_targets(prompt, parsed, m, gt, vocab, rollout_prompt_ids=prompt))
    return segs


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_row_equals_segments_one_by_one(tiny_model, tiny_tokenizer, tiny_vocab):
    torch.manual_seed(0)
    model = tiny_model
    segs = _segments(tiny_tokenizer, tiny_vocab)
    assert all(len(s.coord_positions) for s in segs) and len({len(s) for s in segs}) == len(segs)
    w = LossWeights(ce=1.0, soft_ce=0.7, w1=1.3, gate=0.5, sigma=2.0)
    coord_ids = tiny_vocab.coord_token_ids

    model.zero_grad()
    row = pack(segs, packing_length=4096)
    packed_logits = model(**row.model_inputs()).logits
    packed = compute_loss(packed_logits, row, coord_ids, w)
    packed.loss.backward()
    packed_grads = _grads(model)

    model.zero_grad()
    total = None
    single_logits = []
    for s in segs:
        r = pack([s])
        logits = model(**r.model_inputs()).logits
        single_logits.append(logits.detach()[0])
        sums = loss_sums(logits, r, coord_ids, w.sigma)
        total = sums if total is None else total + sums
    unpacked = total.finish(w)
    unpacked.loss.backward()
    unpacked_grads = _grads(model)

    loss_diff = abs(packed.loss.item() - unpacked.loss.item())
    assert packed.loss.item() > 0
    assert loss_diff <= 1e-5
    for name in ("ce", "soft_ce", "w1", "gate"):
        assert abs(float(packed.parts[name]) - float(unpacked.parts[name])) <= 1e-5, name
    assert packed_grads.keys() == unpacked_grads.keys() and packed_grads
    worst = max(float((packed_grads[n] - unpacked_grads[n]).abs().max()) for n in packed_grads)
    assert worst <= 1e-4
    print(f"packed vs unpacked: loss diff {loss_diff:.2e}, max grad diff {worst:.2e}")

    # The coordinate positions after the offset shift read the same logits as in the lone segment.
    for info, s, lone in zip(row.segments, segs, single_logits, strict=True):
        shifted = row.coord_positions[info.coord_start : info.coord_end]
        assert shifted.tolist() == [info.offset + p for p in s.coord_positions]
        got = packed_logits.detach()[0, shifted - 1]
        want = lone[torch.tensor(s.coord_positions) - 1]
        assert torch.allclose(got, want, atol=1e-4)

    # Control: without restarting position ids the segments attend to each other -> different loss.
    flat = torch.arange(row.length)[None]
    leaky = compute_loss(model(input_ids=row.input_ids, position_ids=flat, use_cache=False).logits, row, coord_ids, w)
    assert abs(leaky.loss.item() - unpacked.loss.item()) > 1e-3
