"""Y_train = own prefix + missed objects + closing bracket + end-of-turn, with labels and coord targets,
for coordexp (`}`, coord tokens) and qwen_json (`]`, plain-text coordinates, cross-entropy only)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from core_helpers import object_lists, pairs_to_value, render, split_preamble
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from learner.core.codec import COORDEXP, QWEN_JSON, DetObject, OutputFormat, QwenJsonFormat
from learner.core.match import match
from learner.core.parse import parse
from learner.core.targets import IGNORE_INDEX, PromptMismatchError, TargetConfig, TargetError, build_targets

CAT = DetObject("cat", "bbox_2d", (100, 100, 300, 300))
DOG = DetObject("dog", "poly", (500, 500, 700, 500, 600, 700))
BIRD = DetObject("bird", "bbox_2d", (800, 50, 900, 150))


def y_train_entries(vocab, seg, fmt: OutputFormat = COORDEXP):
    """Y_train's text (without eos) and its top-level entries as (key, value) pairs ((None, value) in a
    list); the JSON after any preamble must be complete and valid."""
    y = list(seg.input_ids[seg.prompt_len :])
    assert y[-1] == vocab.eos_id
    text = vocab.decode_bytes(y[:-1]).decode()
    data = json.loads(split_preamble(text.encode())[1], object_pairs_hook=lambda p: p)
    return text, [(None, v) for v in data] if fmt.container == "list" else data


def build(vocab, prompt, pred_objects, gt, cut=None, cfg=None):
    ids = list(vocab.encode(render(pred_objects))) + [vocab.eos_id]
    if cut is not None:
        ids = ids[:cut]
    parsed = parse(ids, vocab)
    m = match([o.obj for o in parsed.objects], gt)
    return ids, parsed, m, build_targets(prompt, parsed, m, gt, vocab, rollout_prompt_ids=prompt, cfg=cfg)


@pytest.mark.parametrize("vocab_name", ["tiny_vocab", "fused"])
def test_prefix_plus_missed_objects(request, vocab_name):
    vocab = request.getfixturevalue(vocab_name)
    prompt = list(vocab.encode("Detect every object.")) + [vocab.eos_id]
    near_cat = DetObject("kitten", "bbox_2d", (110, 100, 300, 310))
    far = DetObject("ghost", "bbox_2d", (0, 900, 20, 999))
    full = list(vocab.encode(render([near_cat, far, BIRD])))
    # Cut inside the third object: the rollout was truncated.
    ids, parsed, m, seg = build(vocab, prompt, [near_cat, far, BIRD], [CAT, DOG, BIRD], cut=len(full) - 6)
    assert [o.obj for o in parsed.objects] == [near_cat, far]
    assert [(p, g) for p, g, _ in m.pairs] == [(0, 0)] and m.false_negatives == (1, 2)

    assert list(seg.input_ids[: len(prompt)]) == prompt
    assert list(seg.input_ids[len(prompt) : len(prompt) + parsed.n_own_prefix_ids]) == ids[: parsed.n_own_prefix_ids]
    text, pairs = y_train_entries(vocab, seg)
    assert [k for k, _ in pairs] == ["object_1", "object_2", "object_3", "object_4"]
    assert [COORDEXP.validate_entry(k, pairs_to_value(v)) for k, v in pairs] == [near_cat, far, DOG, BIRD]

    # Coordinate targets: matched prefix coords pulled to CAT's bins, then the missed objects' own bins.
    n_prefix_coords = 4
    pos = list(seg.coord_positions)
    assert pos == sorted(pos)
    assert list(seg.coord_bins) == list(CAT.bins) + list(DOG.bins) + list(BIRD.bins)
    assert [p - len(prompt) for p in pos[:n_prefix_coords]] == list(parsed.objects[0].coord_token_indices)
    for p in pos:
        assert seg.input_ids[p] in vocab.coord_bin_of
        assert seg.labels[p] == IGNORE_INDEX
    for p, b in zip(pos[n_prefix_coords:], seg.coord_bins[n_prefix_coords:], strict=True):
        assert vocab.coord_bin_of[seg.input_ids[p]] == b
    # No cross-entropy on the prompt or the rollout's own prefix; prefix ids the parser wrote (a
    # brace split off a fused token) and the tail are supervised, except desc values.
    tail_start = seg.prompt_len + seg.prefix_len
    own_end = seg.prompt_len + parsed.n_own_prefix_ids
    assert all(label == IGNORE_INDEX for label in seg.labels[:own_end])
    assert list(seg.labels[own_end:tail_start]) == list(seg.input_ids[own_end:tail_start])
    assert seg.labels[-1] == vocab.eos_id
    supervised = bytes(
        b
        for i in range(tail_start, len(seg))
        if seg.labels[i] != IGNORE_INDEX
        for b in vocab.token_bytes[seg.input_ids[i]]
    ).decode()
    assert "dog" not in supervised and "bird" not in supervised and "object_3" in supervised
    assert seg.meta["n_fn"] == 2 and seg.meta["n_matched"] == 1 and seg.meta["truncated"]

    _, _, _, seg2 = build(
        vocab, prompt, [near_cat, far, BIRD], [CAT, DOG, BIRD], len(full) - 6, TargetConfig(supervise_fn_desc=True)
    )
    supervised = bytes(
        b
        for i in range(tail_start, len(seg2))
        if seg2.labels[i] != IGNORE_INDEX
        for b in vocab.token_bytes[seg2.input_ids[i]]
    ).decode()
    assert "dog" in supervised and "bird" in supervised


def test_empty_prefix_has_no_leading_comma(tiny_vocab):
    prompt = [1, 2, 3]
    _, parsed, m, seg = build(tiny_vocab, prompt, [], [CAT, DOG])
    text, pairs = y_train_entries(tiny_vocab, seg)
    assert text.startswith('{"object_1"') and [k for k, _ in pairs] == ["object_1", "object_2"]
    _, _, _, seg = build(tiny_vocab, prompt, [CAT], [CAT])  # perfect: Y_train closes the rollout
    text, pairs = y_train_entries(tiny_vocab, seg)
    assert json.loads(text) == json.loads(render([CAT]))
    assert list(seg.coord_bins) == list(CAT.bins)


def test_prompt_mismatch_is_a_clear_error(tiny_vocab):
    ids = list(tiny_vocab.encode(render([CAT]))) + [tiny_vocab.eos_id]
    parsed = parse(ids, tiny_vocab)
    m = match([o.obj for o in parsed.objects], [CAT])
    with pytest.raises(PromptMismatchError, match="at index 2"):
        build_targets([5, 6, 7], parsed, m, [CAT], tiny_vocab, rollout_prompt_ids=[5, 6, 8])
    with pytest.raises(PromptMismatchError, match="lengths 3 vs 4"):
        build_targets([5, 6, 7], parsed, m, [CAT], tiny_vocab, rollout_prompt_ids=[5, 6, 7, 8])


@pytest.mark.parametrize(
    ("vocab_name", "fmt"),
    [
        ("fused", COORDEXP),
        ("fused_plain", QWEN_JSON),
        ("fused_plain", QwenJsonFormat("pixels").for_image(1280, 1000)),
    ],
)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gt=object_lists, pred=object_lists, data=st.data())
def test_y_train_is_valid_and_complete(request, vocab_name, fmt, gt, pred, data):
    vocab = request.getfixturevalue(vocab_name)
    gt = [fmt.as_written(o) for o in gt]  # what episode.ground_truth hands in
    ids = list(vocab.encode(render(pred, fmt))) + [vocab.eos_id]
    ids = ids[: data.draw(st.integers(0, len(ids)))]
    parsed = parse(ids, vocab, fmt)
    m = match([o.obj for o in parsed.objects], gt)
    seg = build_targets([7, 8], parsed, m, gt, vocab, fmt)
    _, pairs = y_train_entries(vocab, seg, fmt)
    tail = [fmt.validate_entry(k, pairs_to_value(v)) for k, v in pairs[parsed.n_entries :]]
    assert tail == [gt[g] for g in m.false_negatives]
    if fmt.container == "object":
        keys = [k for k, _ in pairs]
        new_keys = keys[parsed.n_entries :]
        assert len(set(new_keys)) == len(new_keys) and set(new_keys).isdisjoint(keys[: parsed.n_entries])
    if not fmt.coord_tokens:
        assert seg.coord_positions == () and seg.coord_bins == ()
        return
    assert len(seg.coord_positions) == sum(
        len(gt[g].bins)
        for p, g, _ in m.pairs
        if parsed.objects[p].obj.kind == gt[g].kind and len(parsed.objects[p].obj.bins) == len(gt[g].bins)
    ) + sum(len(gt[g].bins) for g in m.false_negatives)
    for p in seg.coord_positions:
        assert seg.input_ids[p] in vocab.coord_bin_of


@pytest.mark.parametrize(
    ("vocab_name", "fmt"),
    [("tiny_vocab", COORDEXP), ("fused", COORDEXP), ("stock_vocab", QWEN_JSON), ("fused_plain", QWEN_JSON)],
)
@pytest.mark.parametrize("response", ["garbage, no brace", '", "object_1": "x"', "", '{"bbox_2d": [1, 2, 3, 4]}'])
def test_rollout_without_an_opening_brace_is_taught_to_open(request, vocab_name, fmt, response):
    """A rollout with no usable start keeps no ids of its own: the opener (`{`, or qwen_json's `[`) the
    parser puts in the prefix must be supervised, or the model never learns to open the container
    (found in a run: CE fell to 0.02 while every rollout started with `", "` and F1 stayed 0)."""
    if fmt is COORDEXP and response.startswith("{"):
        return  # for coordexp that one opens the object
    vocab = request.getfixturevalue(vocab_name)
    prompt = list(vocab.encode("Detect every object.")) + [vocab.eos_id]
    ids = list(vocab.encode(response)) + [vocab.eos_id]
    parsed = parse(ids, vocab, fmt)
    assert parsed.n_own_prefix_ids == 0
    m = match([], [CAT])
    seg = build_targets(prompt, parsed, m, [CAT], vocab, fmt, rollout_prompt_ids=prompt)
    supervised = [i for i, label in enumerate(seg.labels) if label != IGNORE_INDEX]
    assert supervised[0] == len(prompt)  # the very first response position
    assert vocab.token_bytes[seg.input_ids[supervised[0]]].startswith(fmt.render([])[:1].encode())
    y = bytes(b for t in seg.input_ids[len(prompt) : -1] for b in vocab.token_bytes[t]).decode()
    assert y == fmt.render([CAT])


# ---------------------------------------------------------------- preamble, polygons, stripped descs


def test_preamble_is_kept_without_loss(tiny_vocab):
    """Text before the `{` is the rollout's own: kept in Y_train, never supervised."""
    vocab, prompt = tiny_vocab, [1, 2, 3]
    ids = list(vocab.encode("Sure: " + render([CAT, BIRD])[:-10])) + [vocab.eos_id]  # BIRD cut off
    parsed = parse(ids, vocab)
    assert [o.obj for o in parsed.objects] == [CAT]
    m = match([o.obj for o in parsed.objects], [CAT, DOG])
    seg = build_targets(prompt, parsed, m, [CAT, DOG], vocab, rollout_prompt_ids=prompt)
    text, pairs = y_train_entries(vocab, seg)
    assert text.startswith('Sure: {"object_1": ') and text == "Sure: " + render([CAT, DOG])
    preamble_ids = len(vocab.encode("Sure:"))
    assert all(label == IGNORE_INDEX for label in seg.labels[: len(prompt) + preamble_ids])
    assert list(seg.coord_bins) == list(CAT.bins) + list(DOG.bins)


@pytest.mark.parametrize("vocab_name", ["tiny_vocab", "fused"])
def test_matched_polygon_in_pairs_gets_the_coordinate_loss(request, vocab_name):
    vocab, prompt = request.getfixturevalue(vocab_name), [1, 2, 3]
    near_dog = DetObject("dog", "poly", (505, 500, 700, 505, 600, 690))
    ids = list(vocab.encode(COORDEXP.render([near_dog]))) + [vocab.eos_id]
    assert '[["<|coord_505|>", "<|coord_500|>"], ' in COORDEXP.render([near_dog])  # pairs, CoordExp's form
    parsed = parse(ids, vocab)
    m = match([o.obj for o in parsed.objects], [DOG])
    assert [(p, g) for p, g, _ in m.pairs] == [(0, 0)]
    seg = build_targets(prompt, parsed, m, [DOG], vocab, rollout_prompt_ids=prompt)
    # The matched polygon's own coord tokens, in the rollout's prefix, are pulled to DOG's bins.
    assert [p - len(prompt) for p in seg.coord_positions] == list(parsed.objects[0].coord_token_indices)
    assert list(seg.coord_bins) == list(DOG.bins)
    assert [vocab.coord_bin_of[seg.input_ids[p]] for p in seg.coord_positions] == list(near_dog.bins)


def test_ground_truth_desc_whitespace_never_reaches_the_tail(tiny_vocab, stock_vocab):
    for vocab, fmt in ((tiny_vocab, COORDEXP), (stock_vocab, QWEN_JSON)):
        spaced = DetObject("  cat \t", "bbox_2d", CAT.bins)
        parsed = parse([vocab.eos_id], vocab, fmt)
        seg = build_targets([1], parsed, match([], [spaced]), [spaced], vocab, fmt, cfg=TargetConfig(True))
        text, _ = y_train_entries(vocab, seg, fmt)
        assert text == fmt.render([CAT]) and '"cat"' in text
        # And a predicted " cat " matches ground truth "cat": same object.
        pred = '{"object_1": {"desc": " cat ", "bbox_2d": [' if fmt is COORDEXP else '[{"bbox_2d": ['
        body = (
            ", ".join(f'"<|coord_{b}|>"' for b in CAT.bins) + "]}}"
            if fmt is COORDEXP
            else ", ".join(str(b) for b in CAT.bins) + '], "label": " cat "}]'
        )
        parsed = parse(list(vocab.encode(pred + body)) + [vocab.eos_id], vocab, fmt)
        assert [o.obj for o in parsed.objects] == [CAT]


def test_coordexp_targets_need_coord_tokens(stock_vocab):
    parsed = parse([stock_vocab.eos_id], stock_vocab, QWEN_JSON)
    with pytest.raises(ValueError, match="prepare-model"):
        build_targets([1], parsed, match([], [CAT]), [CAT], stock_vocab, COORDEXP)


# ---------------------------------------------------------------- qwen_json end to end


def _qbox(fmt: OutputFormat, label: str, coords: list[int]) -> DetObject:
    """An object as `fmt` reads it from the model's own numbers (so it writes back to exactly them)."""
    obj = fmt.validate_entry(None, {"bbox_2d": coords, "label": label})
    assert obj is not None
    return obj


@pytest.mark.parametrize("coordinates", ["relative", "pixels"])
def test_qwen_json_end_to_end(stock_vocab, coordinates):
    """Ground truth rendered -> tokenized with a real tokenizer that has no coord tokens -> a partly right
    rollout parsed -> matched -> Y_train: the rollout's prefix kept, the missed objects appended, CE only."""
    vocab = stock_vocab
    assert vocab.coord_token_ids == ()
    fmt = QwenJsonFormat(coordinates).for_image(640, 480)  # a pixels format is bound to the resized image
    rel = coordinates == "relative"
    cat = _qbox(fmt, "cat", [100, 100, 300, 300] if rel else [64, 48, 192, 144])
    bird = _qbox(fmt, "bird", [800, 50, 900, 150] if rel else [512, 24, 576, 72])
    dog_poly = DetObject("dog", "poly", (500, 500, 700, 500, 600, 700))
    gt = [cat, fmt.as_written(dog_poly), bird]  # as learner.data.episode.ground_truth hands it in
    assert gt[1] == DetObject("dog", "bbox_2d", (500, 500, 700, 700))
    kitten = _qbox(fmt, "kitten", [110, 100, 300, 310] if rel else [70, 48, 192, 149])
    ghost = _qbox(fmt, "ghost", [0, 900, 20, 999] if rel else [0, 432, 13, 479])

    # The ground truth as the model should write it, through the real tokenizer and back.
    gt_ids = list(vocab.encode(fmt.render(gt))) + [vocab.eos_id]
    assert [o.obj for o in parse(gt_ids, vocab, fmt).objects] == gt

    # A rollout in a ```json fence: kitten (matches cat), ghost (no match), then bird cut off mid-way.
    full = "```json\n" + fmt.render([kitten, ghost, bird])
    response = list(vocab.encode(full[: full.index('"bird"')])) + [vocab.eos_id]
    prompt = list(vocab.encode("Detect every object.")) + [vocab.eos_id]
    parsed = parse(response, vocab, fmt)
    assert [o.obj for o in parsed.objects] == [kitten, ghost] and parsed.truncated and parsed.n_dropped == 0
    assert all(o.coord_token_indices == () for o in parsed.objects)
    m = match([o.obj for o in parsed.objects], gt)
    assert [(p, g) for p, g, _ in m.pairs] == [(0, 0)] and m.false_negatives == (1, 2) and m.false_positives == (1,)
    seg = build_targets(prompt, parsed, m, gt, vocab, fmt, rollout_prompt_ids=prompt)

    # Y_train: prompt, the rollout's own prefix (fence, kitten, ghost), then `, {dog}, {bird}]` + eos.
    n_own = parsed.n_own_prefix_ids
    assert list(seg.input_ids[: len(prompt)]) == prompt
    assert list(seg.input_ids[len(prompt) : len(prompt) + n_own]) == response[:n_own]
    text, pairs = y_train_entries(vocab, seg, fmt)
    assert text == "```json\n" + fmt.render([kitten, ghost, gt[1], bird])
    assert [fmt.validate_entry(None, pairs_to_value(v)) for _, v in pairs] == [kitten, ghost, gt[1], bird]
    assert [o.obj for o in parse(seg.input_ids[len(prompt) :], vocab, fmt).objects] == [kitten, ghost, gt[1], bird]
    tail_text = fmt.render_entries([gt[1], bird], 3)
    assert text.endswith(", " + tail_text + "]")
    if not rel:  # the appended boxes are in the resized image's pixels
        assert '"bbox_2d": [320, 240, 448, 336], "label": "dog"' in tail_text

    # CE only: no coordinate positions; nothing supervised in the rollout's own ids; the tail is, except
    # the missed objects' labels (supervise_fn_desc off), the eos included.
    assert seg.coord_positions == () and seg.coord_bins == ()
    own_end = len(prompt) + n_own
    assert all(label == IGNORE_INDEX for label in seg.labels[:own_end])
    tail_start = seg.prompt_len + seg.prefix_len
    assert list(seg.labels[own_end:tail_start]) == list(seg.input_ids[own_end:tail_start])
    assert seg.labels[-1] == vocab.eos_id
    supervised = bytes(
        b
        for i in range(tail_start, len(seg))
        if seg.labels[i] != IGNORE_INDEX
        for b in vocab.token_bytes[seg.input_ids[i]]
    ).decode()
    assert '"bbox_2d": [' in supervised and '"label": "' in supervised and supervised.endswith("]<|im_end|>")
    assert "dog" not in supervised and "bird" not in supervised
    dog_digits = ", ".join(str(v) for v in json.loads("[" + tail_text + "]")[0]["bbox_2d"])
    assert dog_digits in supervised  # the coordinates are learnt by cross-entropy
    assert seg.meta["n_fn"] == 2 and seg.meta["n_matched"] == 1 and seg.meta["matched_unsupervised"] == 0

    seg2 = build_targets(prompt, parsed, m, gt, vocab, fmt, rollout_prompt_ids=prompt, cfg=TargetConfig(True))
    supervised = bytes(
        b
        for i in range(tail_start, len(seg2))
        if seg2.labels[i] != IGNORE_INDEX
        for b in vocab.token_bytes[seg2.input_ids[i]]
    ).decode()
    assert "dog" in supervised and "bird" in supervised

    # A perfect rollout: Y_train closes it with `]` and teaches nothing but the close and the eos.
    perfect = list(vocab.encode(fmt.render(gt))) + [vocab.eos_id]
    parsed = parse(perfect, vocab, fmt)
    seg = build_targets(prompt, parsed, match([o.obj for o in parsed.objects], gt), gt, vocab, fmt)
    assert y_train_entries(vocab, seg, fmt)[0] == fmt.render(gt)
    assert vocab.decode_bytes([t for t in seg.labels if t != IGNORE_INDEX]) in (b"]" + b"<|im_end|>", b"}]<|im_end|>")


def test_tail_with_a_coord_token_under_a_plain_format_is_an_error(fused):
    # A vocabulary with coord tokens and a plain-text format: the tail never holds one; if an encoder
    # produced one anyway, the targets refuse it rather than train on it.
    def sneaky(text: str) -> list[int]:
        return [fused.coord_token_ids[1]] + fused.encode(text)

    vocab = dataclasses.replace(fused, encode=sneaky)
    parsed = parse([vocab.eos_id], vocab, QWEN_JSON)
    with pytest.raises(TargetError, match="coord tokens"):
        build_targets([1], parsed, match([], [CAT]), [CAT], vocab, QWEN_JSON)
