"""Recipe generation 2 as the reference's code runs it (issue 43; docs/method.md, "Against the reference"): dead
anchors out of the prefix, duplicate clusters with their exemptions and survivor, CE on the prefix's labels,
weighted means, the rollouts' repetition penalty. Each test fails with its part switched off or taken out."""

from __future__ import annotations

import pytest
import torch

from learner.core.clean_prefix import (
    CleanPrefixConfig,
    DuplicateConfig,
    build_clean_targets,
    dead_anchors,
    find_duplicates,
    label_support,
)
from learner.core.codec import COORDEXP, DetObject
from learner.core.losses import LossWeights, compute_loss, loss_sums
from learner.core.match import MatchConfig, match, pair_by_iou
from learner.core.packing import pack
from learner.core.parse import parse
from learner.core.targets import IGNORE_INDEX
from learner.data.episode import build_segments, ground_truth
from learner.data.records import Record

PROMPT = [5, 6, 7]
MATCHING = MatchConfig(iou_gate=0.5, fp_cost=1.0, fn_cost=1.2)
CAT = DetObject("cat", "bbox_2d", (100, 100, 300, 300))
DOG = DetObject("dog", "bbox_2d", (500, 500, 700, 700))
CAR = DetObject("car", "bbox_2d", (800, 50, 900, 150))  # a hallucination: no ground truth near it


def _answer(vocab, objects) -> list[int]:
    return list(vocab.encode(COORDEXP.render(objects))) + [vocab.eos_id]


def _record(objects: list[DetObject]) -> Record:
    """A 1000 x 1000 image: pixel coordinates are the bins."""
    return Record.model_validate(
        {
            "id": "r",
            "width": 1000,
            "height": 1000,
            "messages": [{"role": "user", "content": "Detect."}],
            "objects": [{"desc": o.desc, "bbox_2d": list(o.bins)} for o in objects],
        }
    )


def _segment(vocab, answer, gt, explorers=(), clean=None, dup=None):
    rec = _record(gt)
    assert ground_truth(rec) == list(gt)  # the grid is the image: the objects as written
    segs, stats = build_segments(
        [rec],
        [PROMPT],
        [PROMPT],
        [_answer(vocab, answer)],
        vocab,
        MATCHING,
        clean=clean or CleanPrefixConfig(),
        duplicates=dup,
        explorer_ids=[[_answer(vocab, e) for e in explorers]],
    )
    return segs[0], stats


def _text(vocab, seg) -> str:
    return vocab.decode_bytes(seg.input_ids[len(PROMPT) : -1]).decode()


def _supervised(vocab, seg) -> list[tuple[str, float]]:
    weights = seg.ce_weights or tuple(0.0 if lab == IGNORE_INDEX else 1.0 for lab in seg.labels)
    return [
        (vocab.token_bytes[t].decode(errors="replace"), w)
        for t, lab, w in zip(seg.input_ids, seg.labels, weights, strict=True)
        if lab != IGNORE_INDEX
    ]


# -- dead anchors --------------------------------------------------------------------------------------------
def test_a_dead_anchor_leaves_the_prefix_and_closing_is_trained_after_the_last_kept_object(tiny_vocab) -> None:
    seg, stats = _segment(tiny_vocab, [CAT, DOG, CAR], [CAT, DOG])
    # The car, matched to nothing and held by no explorer, is gone: after the dog comes the closing bracket.
    assert _text(tiny_vocab, seg) == COORDEXP.render([CAT, DOG])
    assert seg.meta["n_dead"] == 1 and stats.dead == 1
    assert (stats.matched, stats.false_positives) == (2, 1)  # the answer's own figures, the car counted
    closing = _supervised(tiny_vocab, seg)[-2:]
    assert closing[0][0].endswith("}") and closing[0][1] == 1.0 and closing[1][1] == 1.0
    # Kept (the setting's other value): the car stays in the prefix and "continue" is what the dog is followed by.
    kept, stats = _segment(tiny_vocab, [CAT, DOG, CAR], [CAT, DOG], clean=CleanPrefixConfig(dead_anchors=False))
    assert _text(tiny_vocab, kept) == COORDEXP.render([CAT, DOG, CAR]) and stats.dead == 0


def test_an_image_with_nothing_trains_closing_at_once_not_the_hallucinations(tiny_vocab) -> None:
    seg, stats = _segment(tiny_vocab, [CAR, DetObject("car", "bbox_2d", (100, 700, 200, 800))], [])
    assert _text(tiny_vocab, seg) == COORDEXP.render([]) and stats.fallback == 1
    kept, _ = _segment(
        tiny_vocab,
        [CAR, DetObject("car", "bbox_2d", (100, 700, 200, 800))],
        [],
        clean=CleanPrefixConfig(dead_anchors=False),
    )
    assert len(_supervised(tiny_vocab, kept)) > 3 * len(_supervised(tiny_vocab, seg))


def test_an_explorer_that_found_the_same_object_keeps_it_in_the_prefix(tiny_vocab) -> None:
    near_car = DetObject("horse", "bbox_2d", (801, 50, 900, 151))  # labels play no part in triage
    seg, stats = _segment(tiny_vocab, [CAT, CAR], [CAT, DOG], explorers=[[DOG, near_car]])
    assert _text(tiny_vocab, seg) == COORDEXP.render([CAT, CAR, DOG]) and stats.dead == 0
    assert stats.recovered == 1  # the explorer also found the dog the anchor missed


def test_what_supports_an_unmatched_anchor() -> None:
    kept = [CAT, CAR]
    m = match(kept, [CAT], MATCHING)
    assert dead_anchors(kept, m, [], 0.9) == [1]  # no explorer: every unmatched object is dead
    assert dead_anchors(kept, m, [([CAR], set())], 0.9) == []
    # The explorer matched its copy to the ground truth: it is not evidence for an unmatched anchor.
    assert dead_anchors(kept, m, [([CAR], {0})], 0.9) == [1]
    # Below the support IoU: no support.
    assert dead_anchors(kept, m, [([DetObject("car", "bbox_2d", (830, 50, 930, 150))], set())], 0.9) == [1]
    # An unmatched object repeating a matched one is not held by the explorer's copy of that one.
    twin = DetObject("lion", "bbox_2d", (101, 100, 300, 301))
    m2 = match([CAT, twin], [CAT], MATCHING)
    assert dead_anchors([CAT, twin], m2, [([DetObject("x", "bbox_2d", (100, 101, 301, 300)), CAT], set())], 0.9) == [1]


def test_an_unmatched_object_of_an_lvis_verified_category_is_dead_even_when_an_explorer_holds_it(tiny_vocab):
    """The reference's triage with LVIS metadata: a category the image's annotation verified (present and
    exhaustively annotated, or absent) has every instance in the ground truth, so an unmatched one is wrong."""
    from learner.data.records import LvisMeta

    lvis = LvisMeta(pos_categories=["Cat", "car"], neg_categories=["horse"], not_exhaustive_categories=["car"])
    assert lvis.verified() == {"cat", "horse"}  # car: present but not exhaustively annotated
    kept = [
        CAT,
        CAR,
        DetObject("horse", "bbox_2d", (500, 10, 600, 90)),
        DetObject("cat", "bbox_2d", (10, 800, 90, 900)),
    ]
    m = match(kept, [CAT], MATCHING)
    held = [(kept[1:], set())]  # an explorer wrote the same three unmatched objects
    assert dead_anchors(kept, m, held, 0.9) == []
    assert dead_anchors(kept, m, held, 0.9, verified=lvis.verified()) == [2, 3]  # the horse and the second cat
    # Through the episode: a record with the field; without it the explorer keeps the horse.
    horse = kept[2]
    rec = Record.model_validate({**_record([CAT]).model_dump(), "lvis": lvis.model_dump()})
    segs, stats = build_segments(
        [rec],
        [PROMPT],
        [PROMPT],
        [_answer(tiny_vocab, [CAT, horse])],
        tiny_vocab,
        MATCHING,
        clean=CleanPrefixConfig(),
        explorer_ids=[[_answer(tiny_vocab, [horse])]],
    )
    assert _text(tiny_vocab, segs[0]) == COORDEXP.render([CAT]) and stats.dead == 1
    seg, stats = _segment(tiny_vocab, [CAT, horse], [CAT], explorers=[[horse]])
    assert _text(tiny_vocab, seg) == COORDEXP.render([CAT, horse]) and stats.dead == 0


def test_one_to_one_pairing_takes_the_highest_total_iou() -> None:
    a = [DetObject("a", "bbox_2d", (0, 0, 100, 100)), DetObject("a", "bbox_2d", (10, 0, 110, 100))]
    b = [DetObject("b", "bbox_2d", (10, 0, 110, 100))]
    assert pair_by_iou(a, b, 0.5) == {1: 0}  # one each, the better pair
    assert pair_by_iou(a, b, 0.5, allowed=torch.tensor([[True], [False]]).numpy()) == {0: 0}


# -- duplicate clusters --------------------------------------------------------------------------------------
def _row(n: int) -> list[DetObject]:
    """n tall same-label objects side by side (people in a queue): neighbours are duplicate-like by their centres."""
    return [DetObject("person", "bbox_2d", (100 + 100 * i, 300, 200 + 100 * i, 700)) for i in range(n)]


def test_a_row_of_like_objects_is_spread_wide_and_kept_whole() -> None:
    row = _row(6)
    assert find_duplicates(row) == {}
    # Greedy in answer order (the setting's other value) takes every other one out.
    assert find_duplicates(row, DuplicateConfig(clusters=False)) == {1: 0, 3: 2, 5: 4}


def test_a_burst_on_one_object_keeps_one() -> None:
    burst = [CAT, DetObject("cat", "bbox_2d", (102, 100, 300, 302)), CAT, DOG]
    assert find_duplicates(burst) == {1: 0, 2: 0}


def test_a_cluster_two_explorers_members_confirm_is_kept() -> None:
    pair = [CAT, DetObject("cat", "bbox_2d", (140, 100, 340, 300))]  # centres 40 bins apart: duplicate-like
    assert find_duplicates(pair) == {1: 0}
    support = label_support(pair, [pair], 0.9)
    assert support == [1, 1]
    assert find_duplicates(pair, support=support) == {}
    # One member confirmed is not enough; a label the explorer gave otherwise does not confirm.
    assert label_support(pair, [[CAT, DetObject("dog", "bbox_2d", (140, 100, 340, 300))]], 0.9) == [1, 0]


def test_the_survivor_is_the_best_supported_then_off_the_border_then_the_first() -> None:
    edge = DetObject("cat", "bbox_2d", (0, 100, 200, 300))  # touches the grid's border
    a = DetObject("cat", "bbox_2d", (20, 100, 220, 300))
    b = DetObject("cat", "bbox_2d", (30, 100, 230, 300))
    assert find_duplicates([edge, a, b], support=[0, 0, 1]) == {0: 2, 1: 2}  # most supported
    assert find_duplicates([edge, a, b]) == {0: 1, 2: 1}  # then not touching the border
    assert find_duplicates([a, b]) == {1: 0}  # then the first


def test_a_removed_duplicate_gets_unlikelihood_where_it_began(tiny_vocab) -> None:
    # The later copy survives (the explorer holds it), the first is removed: its term sits at the prefix's start.
    first, second = DetObject("cat", "bbox_2d", (105, 100, 305, 300)), CAT
    seg, stats = _segment(tiny_vocab, [first, second], [CAT], explorers=[[CAT]])
    assert stats.duplicates == 1 and _text(tiny_vocab, seg) == COORDEXP.render([CAT])
    assert len(seg.ul_positions) == 1


# -- labels of the prefix ------------------------------------------------------------------------------------
def test_the_labels_of_kept_objects_get_cross_entropy(tiny_vocab) -> None:
    parsed = parse(_answer(tiny_vocab, [CAT, CAR]), tiny_vocab, COORDEXP)
    m = match([CAT, CAR], [CAT, DOG], MATCHING)

    def label_weights(cfg: CleanPrefixConfig) -> dict[str, float]:
        seg = build_clean_targets(PROMPT, parsed, {}, m, [CAT, DOG], tiny_vocab, cfg=cfg)
        weights = seg.ce_weights or tuple(0.0 if lab == IGNORE_INDEX else 1.0 for lab in seg.labels)
        return {
            tiny_vocab.token_bytes[t].decode(): w
            for t, w in zip(seg.input_ids, weights, strict=True)
            if tiny_vocab.token_bytes[t] in (b"cat", b"car", b"dog")
        }

    # Matched (cat) and unmatched (car) alike, at the structure weight; the appended dog as before.
    assert label_weights(CleanPrefixConfig(structure_ce=0.5)) == {"cat": 0.5, "car": 0.5, "dog": 1.0}
    assert label_weights(CleanPrefixConfig(structure_ce=0.5, prefix_labels=False)) == {
        "cat": 0.0,
        "car": 0.0,
        "dog": 1.0,
    }


# -- weighted means ------------------------------------------------------------------------------------------
def test_weights_reweight_the_mean_instead_of_adding_loss(tiny_vocab) -> None:
    parsed = parse(_answer(tiny_vocab, [CAT]), tiny_vocab, COORDEXP)
    m = match([CAT], [CAT, DOG], MATCHING)
    seg = build_clean_targets(PROMPT, parsed, {}, m, [CAT, DOG], tiny_vocab, recovered={1})
    row = pack([seg])
    ids = tiny_vocab.coord_token_ids
    logits = torch.randn(len(seg), tiny_vocab.vocab_size, generator=torch.Generator().manual_seed(0))
    pos = [i for i, lab in enumerate(seg.labels) if lab != IGNORE_INDEX]
    w = torch.tensor([seg.ce_weights[i] for i in pos])
    ce = torch.nn.functional.cross_entropy(
        logits[[i - 1 for i in pos]], torch.tensor([seg.labels[i] for i in pos]), reduction="none"
    )
    assert w.max() == 2.0 and w.min() == 1.0
    only_ce = dict(soft_ce=0.0, w1=0.0, gate=0.0)
    weighted = compute_loss(logits, row, ids, LossWeights(**only_ce, weighted_mean=True))
    counted = compute_loss(logits, row, ids, LossWeights(**only_ce))
    assert weighted.parts["ce"].item() == pytest.approx(((ce * w).sum() / w.sum()).item(), rel=1e-5)
    assert counted.parts["ce"].item() == pytest.approx(((ce * w).sum() / len(pos)).item(), rel=1e-5)
    # Every weight doubled: the weighted mean is unchanged, the counted one doubles.
    assert loss_sums(logits, row, ids, weighted=True).ce_count == pytest.approx(w.sum().item())
    # Coordinates too: the recovered dog's four weigh 2.
    coord = loss_sums(logits, row, ids, weighted=True)
    assert coord.coord_count == pytest.approx(4 * 1.0 + 4 * 2.0) and coord.box_count == pytest.approx(3.0)


def test_packed_equals_unpacked_with_weighted_means(tiny_vocab) -> None:
    parsed = parse(_answer(tiny_vocab, [CAT]), tiny_vocab, COORDEXP)
    a = build_clean_targets(
        PROMPT, parsed, {}, match([CAT], [CAT, DOG], MATCHING), [CAT, DOG], tiny_vocab, recovered={1}
    )
    b = build_clean_targets(
        PROMPT,
        parse(_answer(tiny_vocab, [DOG]), tiny_vocab, COORDEXP),
        {},
        match([DOG], [DOG], MATCHING),
        [DOG],
        tiny_vocab,
    )
    w = LossWeights(soft_ce=0.1, w1=0.02, coord_ce=0.02, smooth_l1=1.0, ciou=0.5, weighted_mean=True)
    ids = tiny_vocab.coord_token_ids
    g = torch.Generator().manual_seed(1)
    la, lb = (
        torch.randn(len(a), tiny_vocab.vocab_size, generator=g),
        torch.randn(len(b), tiny_vocab.vocab_size, generator=g),
    )
    whole = compute_loss(torch.cat([la, lb])[None], pack([a, b]), ids, w)
    pooled = (loss_sums(la, pack([a]), ids, w.sigma, True) + loss_sums(lb, pack([b]), ids, w.sigma, True)).finish(w)
    assert torch.allclose(whole.loss, pooled.loss, atol=1e-5)


# -- the rollouts' decoding ----------------------------------------------------------------------------------
def test_the_recipe_samples_with_the_references_repetition_penalty() -> None:
    from learner.train.config import core_configs
    from rmsft.jobspec import TrainingConfig

    def sampling(**training):
        core = core_configs(TrainingConfig.model_validate({"data": {"path": "x.jsonl"}, **training}))
        return core.sampling["repetition_penalty"], (core.recipe.explorer_sampling or {}).get("repetition_penalty")

    assert sampling() == (1.1, 1.1)  # the anchor and the explorer
    assert sampling(recipe={"generation": 1}) == (1.0, None)
    assert sampling(rollout={"repetition_penalty": 1.0}) == (1.0, 1.0)
    core = core_configs(TrainingConfig.model_validate({"data": {"path": "x.jsonl"}}))
    assert core.weights.weighted_mean and core.recipe.clean.prefix_labels and core.recipe.clean.dead_anchors
    assert core.recipe.duplicates.clusters
    first = core_configs(TrainingConfig.model_validate({"data": {"path": "x.jsonl"}, "recipe": {"generation": 1}}))
    assert not first.weights.weighted_mean
