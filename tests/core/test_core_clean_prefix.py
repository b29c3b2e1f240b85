"""The second-generation recipe's channel B: duplicates, the clean prefix, closure, explorers, box terms."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.core.clean_prefix import (
    CleanPrefixConfig,
    DuplicateConfig,
    build_clean_targets,
    find_duplicates,
    normalize_label,
)
from learner.core.codec import COORDEXP, QWEN_JSON, DetObject
from learner.core.losses import LossWeights, box_terms, compute_loss, expected_coord, loss_sums
from learner.core.match import MatchConfig, match
from learner.core.packing import pack
from learner.core.parse import parse
from learner.core.schedule import is_channel_b
from learner.core.targets import IGNORE_INDEX, TargetError

PROMPT = [5, 6, 7]
CAT = DetObject("cat", "bbox_2d", (100, 100, 300, 300))
DOG = DetObject("dog", "bbox_2d", (500, 500, 700, 700))
BIRD = DetObject("bird", "bbox_2d", (10, 600, 90, 900))


def answer(vocab, objects, *, close=True) -> list[int]:
    text = COORDEXP.render(objects) if close else COORDEXP.render(objects)[:-1]
    return list(vocab.encode(text)) + ([vocab.eos_id] if close else [])


def build(vocab, response, gt, cfg=None, recovered=(), dup_cfg=None, fmt=COORDEXP):
    parsed = parse(response, vocab, fmt)
    objs = [o.obj for o in parsed.objects]
    dups = find_duplicates(objs, dup_cfg or DuplicateConfig())
    kept = [o for i, o in enumerate(objs) if i not in dups]
    m = match(kept, gt, MatchConfig(iou_gate=0.5, fp_cost=1.0, fn_cost=1.2))
    return build_clean_targets(PROMPT, parsed, dups, m, gt, vocab, fmt, cfg=cfg, recovered=recovered), dups


def response_text(vocab, seg) -> str:
    return vocab.decode_bytes(seg.input_ids[len(PROMPT) : -1]).decode()


# -- duplicates ----------------------------------------------------------------------------------------------
def test_normalize_label() -> None:
    assert normalize_label("  Red_Car (big)/x ") == "red car big x"


def test_duplicates_need_the_same_label_and_overlap() -> None:
    near = DetObject("Cat", "bbox_2d", (101, 100, 300, 301))  # IoU ~0.99 with CAT, label differs only in case
    other_label = DetObject("dog", "bbox_2d", (100, 100, 300, 300))
    far = DetObject("cat", "bbox_2d", (600, 600, 800, 800))
    assert find_duplicates([CAT, near, other_label, far]) == {1: 0}
    # Same centre, IoU 0.25 (a box inside another, half the side): a duplicate by the centre radius only.
    inner = DetObject("cat", "bbox_2d", (150, 150, 250, 250))
    assert find_duplicates([CAT, inner]) == {1: 0}
    assert find_duplicates([CAT, inner], DuplicateConfig(center_radius=0.0)) == {}
    # A burst: every repeat points at the first, which stays.
    assert find_duplicates([CAT, CAT, DOG, CAT]) == {1: 0, 3: 0}


# -- the clean prefix ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab_name", ["tiny_vocab", "fused"])
def test_duplicate_leaves_the_prefix_and_gets_unlikelihood(request, vocab_name) -> None:
    vocab = request.getfixturevalue(vocab_name)
    wrong = DetObject("cow", "bbox_2d", (800, 50, 900, 150))  # unmatched, kept
    seg, dups = build(vocab, answer(vocab, [CAT, CAT, wrong]), [CAT, DOG])
    assert dups == {1: 0}
    # The kept objects in the answer's order, renumbered, then the missed dog, then the end.
    assert response_text(vocab, seg) == COORDEXP.render([CAT, wrong, DOG])
    assert seg.input_ids[-1] == vocab.eos_id and seg.meta["n_duplicates"] == 1
    # One unlikelihood term: where the answer with the duplicate put back (after the first cat) parts from
    # Y_train, on the token the duplicate continues with there.
    assert len(seg.ul_positions) == 1
    alt = list(PROMPT) + list(vocab.encode("{")) + list(vocab.encode(COORDEXP.render([CAT, CAT, wrong, DOG])[1:]))
    at = seg.ul_positions[0]
    assert list(seg.input_ids[:at]) == alt[:at] and seg.input_ids[at] != alt[at]
    assert seg.ul_tokens[0] == alt[at]
    # Without duplicate control in the config the duplicate is still removed but not penalised.
    seg_off, _ = build(vocab, answer(vocab, [CAT, CAT, wrong]), [CAT, DOG], CleanPrefixConfig(unlikelihood=False))
    assert seg_off.ul_positions == () and seg_off.input_ids == seg.input_ids


def test_no_duplicate_no_unlikelihood(tiny_vocab) -> None:
    seg, dups = build(tiny_vocab, answer(tiny_vocab, [CAT, DOG]), [CAT, DOG])
    assert dups == {} and seg.ul_positions == ()


def _labels_by_part(vocab, seg):
    """(token text, label supervised?, weight) of the response tokens."""
    weights = seg.ce_weights or tuple(0.0 if lab == IGNORE_INDEX else 1.0 for lab in seg.labels)
    return [
        (vocab.token_bytes[t].decode(errors="replace"), lab != IGNORE_INDEX, w)
        for t, lab, w in zip(seg.input_ids, seg.labels, weights, strict=True)
    ][len(PROMPT) :]


@pytest.mark.parametrize("vocab_name", ["tiny_vocab", "fused"])
def test_supervision_of_each_part(request, vocab_name) -> None:
    tiny_vocab = request.getfixturevalue(vocab_name)
    wrong = DetObject("cow", "bbox_2d", (800, 50, 900, 150))
    seg, _ = build(tiny_vocab, answer(tiny_vocab, [CAT, wrong]), [CAT, DOG], CleanPrefixConfig(structure_ce=0.0))
    parts = _labels_by_part(tiny_vocab, seg)
    # structure_ce 0: nothing of the model's own objects carries a label...
    body = COORDEXP.render([CAT, wrong, DOG])
    kept_end = len(("{" + COORDEXP.render_entries([CAT, wrong], 1)).encode())
    pos, own = 0, []
    for text, sup, _ in parts[:-1]:
        if pos + len(text.encode()) <= kept_end:
            own.append(sup)
        pos += len(text.encode())
    assert own and not any(own)
    # ... but the closing bracket and the end of turn always do.
    assert parts[-1][1] and parts[-2][0].endswith("}") and parts[-2][1]
    # Also when nothing was missed and the bracket shares a token with the last kept entry (`}}` fused).
    alone, _ = build(tiny_vocab, answer(tiny_vocab, [CAT]), [CAT], CleanPrefixConfig(structure_ce=0.0))
    tail = _labels_by_part(tiny_vocab, alone)
    assert tail[-1][1] and tail[-2][0].endswith("}") and tail[-2][1]
    assert sum(sup for _, sup, _ in tail) == 2
    assert seg.labels[-1] == tiny_vocab.eos_id
    # Coordinates: the matched cat's towards its ground truth, the missed dog's; none for the unmatched cow.
    assert list(seg.coord_bins) == list(CAT.bins) + list(DOG.bins)
    assert body.count("<|coord_") == 12
    # Box groups for the matched and the appended box.
    assert [tuple(b) for b in seg.box_bins] == [CAT.bins, DOG.bins]


def test_labels_of_appended_objects_are_supervised_by_default(tiny_vocab) -> None:
    seg, _ = build(tiny_vocab, answer(tiny_vocab, []), [DOG])
    sup_text = b"".join(
        tiny_vocab.token_bytes[t] for t, lab in zip(seg.input_ids, seg.labels, strict=True) if lab != IGNORE_INDEX
    )
    assert b"dog" in sup_text
    seg2, _ = build(tiny_vocab, answer(tiny_vocab, []), [DOG], CleanPrefixConfig(supervise_fn_desc=False))
    sup_text2 = b"".join(
        tiny_vocab.token_bytes[t] for t, lab in zip(seg2.input_ids, seg2.labels, strict=True) if lab != IGNORE_INDEX
    )
    assert b"dog" not in sup_text2 and b"desc" in sup_text2


def test_recovered_objects_weigh_double_on_label_and_coordinates(tiny_vocab) -> None:
    seg, _ = build(tiny_vocab, answer(tiny_vocab, [CAT]), [CAT, DOG, BIRD], recovered={1})
    assert seg.meta["n_recovered"] == 1
    weights = dict(zip(seg.coord_bins, seg.coord_weights, strict=True))
    assert [weights[b] for b in DOG.bins] == [2.0] * 4 and [weights[b] for b in BIRD.bins[:2]] == [1.0] * 2
    assert list(seg.box_weights) == [1.0, 2.0, 1.0]
    # The dog's label tokens carry weight 2, structure tokens weight 1.
    dog_label = [w for t, w in zip(seg.input_ids, seg.ce_weights, strict=True) if tiny_vocab.token_bytes[t] == b"dog"]
    assert dog_label and set(dog_label) == {2.0}
    assert max(w for w in seg.ce_weights if w) == 2.0 and 1.0 in seg.ce_weights
    # Unweighted without recovered objects.
    plain, _ = build(tiny_vocab, answer(tiny_vocab, [CAT]), [CAT, DOG, BIRD])
    assert plain.ce_weights is None and plain.coord_weights is None


@pytest.mark.parametrize("response", [[], "garbage", "truncated"])
def test_invalid_answer_falls_back_to_the_ground_truth(tiny_vocab, response) -> None:
    if response == "garbage":
        response = list(tiny_vocab.encode("I see a cat and a dog")) + [tiny_vocab.eos_id]
    elif response == "truncated":
        response = answer(tiny_vocab, [CAT], close=False)[:-6]  # cut inside the only object
    seg, _ = build(tiny_vocab, response, [CAT, DOG])
    channel_a, _ = build(tiny_vocab, [], [CAT, DOG])
    assert seg.meta["fallback"] and seg.input_ids == channel_a.input_ids and seg.labels == channel_a.labels
    assert response_text(tiny_vocab, seg) == COORDEXP.render([CAT, DOG])


def test_qwen_json_clean_prefix_has_no_coordinate_targets(stock_vocab) -> None:
    gt = [QWEN_JSON.as_written(CAT), QWEN_JSON.as_written(DOG)]
    ids = list(stock_vocab.encode(QWEN_JSON.render([gt[0], gt[0]]))) + [stock_vocab.eos_id]
    seg, dups = build(stock_vocab, ids, gt, fmt=QWEN_JSON)
    assert dups == {1: 0} and seg.coord_positions == () and seg.box_positions == ()
    assert json.loads(stock_vocab.decode_bytes(seg.input_ids[len(PROMPT) : -1]).decode()) == json.loads(
        QWEN_JSON.render(gt)
    )


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from([CAT, DOG, BIRD, DetObject("cat", "bbox_2d", (102, 98, 301, 300))]), max_size=6),
    st.lists(st.sampled_from([CAT, DOG, BIRD]), min_size=1, max_size=3, unique=True),
)
def test_y_train_is_valid_json_with_every_ground_truth_object(fused, pred, gt) -> None:
    seg, dups = build(fused, answer(fused, pred), gt)
    text = fused.decode_bytes(seg.input_ids[len(PROMPT) : -1]).decode()
    obj = json.loads(text)
    assert list(obj) == [f"object_{i}" for i in range(1, len(obj) + 1)]
    assert len(obj) == len(pred) - len(dups) + seg.meta["n_fn"]
    written = [(v["desc"], tuple(int(c[8:-2]) for c in v["bbox_2d"])) for v in obj.values()]
    kept = [(p.desc, p.bins) for i, p in enumerate(pred) if i not in dups]
    # The model's own objects first (duplicates out), then the ground truth it missed.
    assert written[: len(kept)] == kept
    assert all(w in {(g.desc, g.bins) for g in gt} for w in written[len(kept) :])
    assert all(p < len(seg) for p in seg.ul_positions)


def test_bad_duplicate_index_is_an_error(tiny_vocab) -> None:
    parsed = parse(answer(tiny_vocab, [CAT]), tiny_vocab)
    with pytest.raises(TargetError, match="duplicate index"):
        build_clean_targets(PROMPT, parsed, {3: 0}, match([CAT], [CAT]), [CAT], tiny_vocab)


# -- losses --------------------------------------------------------------------------------------------------
def test_expected_coordinate_and_box_terms_values() -> None:
    logits = torch.full((2, 1000), -1e4)
    logits[0, 0] = logits[0, 999] = 0.0  # half at 0, half at 999: expectation 0.5
    logits[1, 250] = 0.0
    assert torch.allclose(expected_coord(logits), torch.tensor([0.5, 250 / 999]))
    same = torch.tensor([[0.1, 0.2, 0.5, 0.6]])
    l1, ciou = box_terms(same, same)
    assert l1.item() == pytest.approx(0.0) and ciou.item() == pytest.approx(0.0, abs=1e-6)
    # A box shifted by 0.1 in x: SmoothL1 (beta 1) = mean of 0.5 * 0.1^2 over the two x coordinates.
    shifted = same + torch.tensor([[0.1, 0.0, 0.1, 0.0]])
    l1, ciou = box_terms(shifted, same)
    assert l1.item() == pytest.approx(0.5 * 0.01 * 2 / 4)
    inter, union = 0.3 * 0.4, 2 * 0.4 * 0.4 - 0.3 * 0.4
    rho2, c2 = 0.1**2, 0.5**2 + 0.4**2
    assert ciou.item() == pytest.approx(1 - (inter / union - rho2 / c2), abs=1e-5)
    # Corners written in the wrong order count as the box they span.
    flipped = same[:, [2, 3, 0, 1]]
    assert box_terms(flipped, same)[1].item() == pytest.approx(0.0, abs=1e-6)


def test_box_terms_pull_the_expectation_towards_the_target() -> None:
    logits = torch.zeros(4, 1000, requires_grad=True)  # uniform: every expectation 0.5
    target = torch.tensor([[0.1, 0.1, 0.3, 0.3]])
    l1, ciou = box_terms(expected_coord(logits)[None, :], target)
    (l1 + 0.5 * ciou).sum().backward()
    grad = logits.grad
    # Lowering the loss means moving probability towards low bins for every coordinate (targets < 0.5).
    assert (grad[:, :100].mean(1) < 0).all() and (grad[:, 900:].mean(1) > 0).all()
    assert torch.isfinite(grad).all()


def _segments(vocab):
    wrong = DetObject("cow", "bbox_2d", (800, 50, 900, 150))
    a, _ = build(vocab, answer(vocab, [CAT, CAT, wrong]), [CAT, DOG], recovered={1})
    b, _ = build(vocab, answer(vocab, [DOG]), [DOG, BIRD])
    return a, b


def test_packed_row_loss_equals_unpacked_with_every_recipe_term(tiny_vocab) -> None:
    a, b = _segments(tiny_vocab)
    w = LossWeights(soft_ce=0.1, w1=0.02, coord_ce=0.02, smooth_l1=1.0, ciou=0.5, unlikelihood=1.0)
    ids = tiny_vocab.coord_token_ids
    vocab_size = tiny_vocab.vocab_size
    g = torch.Generator().manual_seed(0)
    la, lb = torch.randn(len(a), vocab_size, generator=g), torch.randn(len(b), vocab_size, generator=g)
    packed = pack([a, b])
    assert packed.n_unlikelihood == 1 and packed.n_boxes == 4 and packed.ce_weights is not None
    whole = compute_loss(torch.cat([la, lb])[None], packed, ids, w)
    pooled = (loss_sums(la, pack([a]), ids, w.sigma) + loss_sums(lb, pack([b]), ids, w.sigma)).finish(w)
    assert torch.allclose(whole.loss, pooled.loss, atol=1e-5)
    assert whole.parts["ul"].item() > 0 and whole.parts["geo"].item() > 0


def test_unlikelihood_and_weights_change_the_loss_as_written(tiny_vocab) -> None:
    a, _ = _segments(tiny_vocab)
    row = pack([a])
    ids = tiny_vocab.coord_token_ids
    logits = torch.randn(len(a), tiny_vocab.vocab_size, generator=torch.Generator().manual_seed(1))
    sums = loss_sums(logits, row, ids)
    p = torch.softmax(logits[a.ul_positions[0] - 1], -1)[a.ul_tokens[0]]
    assert sums.ul_sum.item() == pytest.approx(-math.log(1 - p.item()), rel=1e-5)
    # The weighted CE sum is the plain per-token CE times each position's weight.
    pos = [i for i, lab in enumerate(a.labels) if lab != IGNORE_INDEX]
    ce = torch.nn.functional.cross_entropy(
        logits[[i - 1 for i in pos]], torch.tensor([a.labels[i] for i in pos]), reduction="none"
    )
    assert sums.ce_sum.item() == pytest.approx(
        (ce * torch.tensor([a.ce_weights[i] for i in pos])).sum().item(), rel=1e-5
    )
    assert sums.ce_count == len(pos)


def test_first_generation_loss_is_unchanged_by_the_new_terms(tiny_vocab) -> None:
    # Weights of the new terms at 0 (the first generation) leave the loss exactly the old formula.
    a, b = _segments(tiny_vocab)
    row = pack([a, b])
    logits = torch.randn(row.length, tiny_vocab.vocab_size, generator=torch.Generator().manual_seed(2))
    s = loss_sums(logits, row, tiny_vocab.coord_token_ids)
    out = s.finish(LossWeights())
    expected = s.ce_sum / s.ce_count + (s.soft_ce_sum + s.w1_sum + s.gate_sum) / s.coord_count
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)


# -- the schedule --------------------------------------------------------------------------------------------
def test_channel_schedule() -> None:
    assert [k for k in range(60) if is_channel_b(k, 0.05)] == [19, 39, 59]
    assert "".join("B" if is_channel_b(k, 0.25) else "A" for k in range(8)) == "AAABAAAB"
    assert "".join("B" if is_channel_b(k, 0.75) else "A" for k in range(4)) == "ABBB"
    assert not any(is_channel_b(k, 0.0) for k in range(50)) and all(is_channel_b(k, 1.0) for k in range(50))
    assert sum(is_channel_b(k, 0.3) for k in range(1000)) == 300
    with pytest.raises(ValueError):
        is_channel_b(0, 1.5)


def test_hard_coordinate_ce_is_the_whole_vocabulary_cross_entropy(tiny_vocab) -> None:
    a, _ = _segments(tiny_vocab)
    row = pack([a])
    ids = torch.as_tensor(tiny_vocab.coord_token_ids)
    logits = torch.randn(len(a), tiny_vocab.vocab_size, generator=torch.Generator().manual_seed(3))
    sums = loss_sums(logits, row, tiny_vocab.coord_token_ids)
    full = logits[row.coord_positions - 1]
    per = torch.nn.functional.cross_entropy(full, ids[row.coord_bins], reduction="none") * row.coord_weights
    assert sums.coord_ce_sum.item() == pytest.approx(per.sum().item(), rel=1e-5)
