"""Parser properties: never raises, the kept prefix is valid JSON with exactly the kept entries,
coord token indices point at the right ids, and serialize -> tokenize -> parse round-trips, for both
output formats (coordexp's object of coord tokens, qwen_json's list of plain-text boxes)."""

from __future__ import annotations

import json
import unicodedata

import pytest
from core_helpers import entry_pairs, object_lists, pairs_to_value, render, split_preamble
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from learner.core.codec import COORDEXP, QWEN_JSON, CoordExpFormat, DetObject, OutputFormat, QwenJsonFormat
from learner.core.parse import ParsedRollout, parse
from learner.core.vocab import VocabView

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Formats under test; a pixels format bound to >= 1000 pixels a side round-trips every bin exactly.
FORMATS = {
    "coordexp": COORDEXP,
    "coordexp_flat": CoordExpFormat(polygons="flat"),
    "qwen_relative": QWEN_JSON,
    "qwen_pixels": QwenJsonFormat(coordinates="pixels").for_image(1280, 1000),
}
# (vocabulary, format) pairs: coordexp needs coord tokens; qwen_json runs with or without them.
CASES = [
    ("tiny_vocab", "coordexp"),
    ("fused", "coordexp"),
    ("fused", "coordexp_flat"),
    ("stock_vocab", "qwen_relative"),
    ("fused_plain", "qwen_relative"),
    ("tiny_vocab", "qwen_relative"),
    ("stock_vocab", "qwen_pixels"),
    ("fused_plain", "qwen_pixels"),
]


def check_invariants(
    ids: list[int], parsed: ParsedRollout, vocab: VocabView, fmt: OutputFormat = COORDEXP
) -> list[tuple[str | None, object]]:
    n_own = parsed.n_own_prefix_ids
    assert list(parsed.prefix_ids[:n_own]) == list(ids[:n_own]), "own prefix ids must be the rollout's"
    assert len(parsed.prefix_ids) - n_own <= 8, "only the straddling token may be re-encoded"
    pairs = entry_pairs(vocab, parsed.prefix_ids, fmt)  # raises if not valid JSON
    assert len(pairs) == parsed.n_entries == len(parsed.objects) + parsed.n_dropped
    keys = [k for k, _ in pairs]
    pos = 0
    for o in parsed.objects:
        # kept objects are entries, in order (a list's are found by position, an object's by key)
        pos = o.index - 1 if fmt.container == "list" else keys.index(o.key, pos)
        assert fmt.validate_entry(o.key, pairs_to_value(pairs[pos][1])) == o.obj
        pos += 1
        if not fmt.coord_tokens:
            assert o.coord_token_indices == ()
            continue
        assert len(o.coord_token_indices) == len(o.obj.bins)
        for idx, b in zip(o.coord_token_indices, o.obj.bins, strict=True):
            assert idx < n_own
            assert vocab.coord_bin_of[ids[idx]] == b
    assert parsed.max_object_index >= max((o.index for o in parsed.objects), default=0)
    return pairs


def encode_answer(vocab: VocabView, objects, fmt: OutputFormat = COORDEXP) -> list[int]:
    return list(vocab.encode(render(objects, fmt))) + [vocab.eos_id]


@pytest.mark.parametrize(("vocab_name", "fmt_name"), CASES)
@SETTINGS
@given(objects=object_lists)
def test_round_trip(request, vocab_name, fmt_name, objects):
    vocab, fmt = request.getfixturevalue(vocab_name), FORMATS[fmt_name]
    ids = encode_answer(vocab, objects, fmt) + list(vocab.encode("trailing text after eos"))
    parsed = parse(ids, vocab, fmt)
    # qwen_json writes boxes only: a polygon comes back as its enclosing box.
    assert [o.obj for o in parsed.objects] == [fmt.as_written(o) for o in objects]
    if fmt.container == "object":
        assert [o.key for o in parsed.objects] == [f"object_{i + 1}" for i in range(len(objects))]
    else:
        assert [(o.key, o.index) for o in parsed.objects] == [(None, i + 1) for i in range(len(objects))]
    assert parsed.closed and not parsed.truncated and parsed.hit_stop and parsed.n_dropped == 0
    check_invariants(ids, parsed, vocab, fmt)


@pytest.mark.parametrize(("vocab_name", "fmt_name"), CASES)
@SETTINGS
@given(objects=object_lists, data=st.data())
def test_truncated(request, vocab_name, fmt_name, objects, data):
    vocab, fmt = request.getfixturevalue(vocab_name), FORMATS[fmt_name]
    ids = encode_answer(vocab, objects, fmt)
    cut = data.draw(st.integers(0, len(ids)))
    parsed = parse(ids[:cut], vocab, fmt)
    check_invariants(ids, parsed, vocab, fmt)
    kept = [o.obj for o in parsed.objects]
    assert kept == [fmt.as_written(o) for o in objects[: len(kept)]] and parsed.n_dropped == 0
    # Every object whose tokens are all inside the cut (and followed by its closing brace) is kept.
    full_prefix = vocab.decode_bytes(ids[:cut])
    complete = sum(
        1 for i in range(len(objects)) if full_prefix.startswith(render(objects[: i + 1], fmt)[:-1].encode())
    )
    assert len(kept) == complete


@st.composite
def corrupted(draw, vocab: VocabView, fmt: OutputFormat = COORDEXP):
    objects = draw(object_lists)
    ids = list(vocab.encode(render(objects, fmt)))
    coords = [vocab.coord_token_ids[0], vocab.coord_token_ids[999]] if vocab.coord_token_ids else []
    hot = [vocab.eos_id, *vocab.special_ids, *coords, -1, vocab.vocab_size, *vocab.encode('"}],{[: \\7')]
    any_id = st.one_of(st.integers(-3, vocab.vocab_size + 3), st.sampled_from(hot))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["sub", "ins", "del", "cut"]))
        i = draw(st.integers(0, len(ids)))
        if op == "sub" and i < len(ids):
            ids[i] = draw(any_id)
        elif op == "ins":
            ids.insert(i, draw(any_id))
        elif op == "del" and i < len(ids):
            del ids[i]
        elif op == "cut":
            ids = ids[:i]
    return ids


@pytest.mark.parametrize(
    ("vocab_name", "fmt_name", "n"),
    [
        ("tiny_vocab", "coordexp", 700),
        ("fused", "coordexp", 400),
        ("fused", "coordexp_flat", 200),
        ("stock_vocab", "qwen_relative", 400),
        ("tiny_vocab", "qwen_relative", 300),
        ("fused_plain", "qwen_pixels", 300),
    ],
)
def test_corrupted_never_raises(request, vocab_name, fmt_name, n):
    vocab, fmt = request.getfixturevalue(vocab_name), FORMATS[fmt_name]

    @settings(max_examples=n, deadline=None)
    @given(ids=corrupted(vocab, fmt))
    def run(ids):
        parsed = parse(ids, vocab, fmt)
        check_invariants(ids, parsed, vocab, fmt)

    run()


@pytest.mark.parametrize("fmt_name", ["coordexp", "qwen_relative"])
@SETTINGS
@given(ids=st.lists(st.integers(-10, 3300), max_size=120))
def test_garbage_never_raises(tiny_vocab, fmt_name, ids):
    parsed = parse(ids, tiny_vocab, FORMATS[fmt_name])
    check_invariants(ids, parsed, tiny_vocab, FORMATS[fmt_name])


def _manual(vocab: VocabView, text: str) -> list[int]:
    return list(vocab.encode(text)) + [vocab.eos_id]


def _box(k: int) -> str:
    return ", ".join(f'"<|coord_{k + i}|>"' for i in range(4))


def test_invalid_entries_are_dropped_not_repaired(tiny_vocab):
    text = (
        '{"object_1": {"desc": "", "bbox_2d": [' + _box(1) + "]}, "
        '"object_2": {"desc": "cat", "bbox_2d": [' + _box(2) + "]}, "
        '"object_2": {"desc": "dup", "bbox_2d": [' + _box(3) + "]}, "
        '"obj_4": {"desc": "dog", "bbox_2d": [' + _box(4) + "]}, "
        '"object_5": {"desc": "dog", "bbox_2d": [' + _box(5) + '], "extra": 1}, '
        '"object_6": {"desc": "dog", "poly": [' + _box(6) + "]}, "
        '"object_9": {"desc": "bird", "bbox_2d": [' + _box(9) + "]}}"
    )
    ids = _manual(tiny_vocab, text)
    parsed = parse(ids, tiny_vocab)
    check_invariants(ids, parsed, tiny_vocab)
    assert [o.key for o in parsed.objects] == ["object_2", "object_9"]
    assert parsed.n_dropped == 5 and parsed.max_object_index == 9 and parsed.closed


def test_coord_text_must_be_coord_tokens(tiny_vocab):
    good = '{"object_1": {"desc": "cat", "bbox_2d": [' + _box(1) + "]}"
    ids = list(tiny_vocab.encode(good))
    # Respell the first coord token with ordinary byte-level pieces: same text, not a coord id.
    first = next(i for i, t in enumerate(ids) if t in tiny_vocab.coord_bin_of)
    spelled = [t for ch in "<|coord_1|>" for t in tiny_vocab.encode(ch)]
    assert not set(spelled) & set(tiny_vocab.coord_token_ids)
    bad = ids[:first] + spelled + ids[first + 1 :] + [tiny_vocab.eos_id]
    parsed = parse(bad, tiny_vocab)
    check_invariants(bad, parsed, tiny_vocab)
    assert parsed.objects == () and parsed.n_dropped == 1
    # A coord id inside a desc string invalidates the object as well.
    in_desc = tiny_vocab.encode('{"object_1": {"desc": "a') + [tiny_vocab.coord_token_ids[5]]
    in_desc += tiny_vocab.encode('", "bbox_2d": [' + _box(1) + "]}}") + [tiny_vocab.eos_id]
    parsed = parse(in_desc, tiny_vocab)
    check_invariants(in_desc, parsed, tiny_vocab)
    assert parsed.objects == () and parsed.n_dropped == 1


def test_fused_closing_token_is_split(fused):
    obj = DetObject("cat", "bbox_2d", (1, 2, 3, 4))
    ids = fused.encode(render([obj])[:-1] + ', "object_2": {"de')
    assert b'"]},' in [fused.token_bytes[t] for t in ids]  # the object's brace shares a token
    parsed = parse(ids, fused)
    check_invariants(ids, parsed, fused)
    assert [o.obj for o in parsed.objects] == [obj]
    assert parsed.n_own_prefix_ids < len(parsed.prefix_ids)
    assert json.loads(fused.decode_bytes(parsed.prefix_ids).decode() + "}") == json.loads(render([obj]))


def test_stop_cut(tiny_vocab):
    obj = DetObject("cat", "bbox_2d", (1, 2, 3, 4))
    ids = tiny_vocab.encode(render([obj])[:-1]) + [tiny_vocab.eos_id] + tiny_vocab.encode("}")
    parsed = parse(ids, tiny_vocab)
    assert [o.obj for o in parsed.objects] == [obj] and parsed.truncated and parsed.hit_stop


@SETTINGS
@given(text=st.text(max_size=40))
def test_vocab_view_token_bytes_match_the_tokenizer(tiny_vocab, tiny_tokenizer, text):
    ids = tiny_vocab.encode(text)
    # Qwen2's tokenizer class NFC-normalizes its input (hypothesis found U+2126 OHM SIGN -> U+03A9).
    expected = unicodedata.normalize("NFC", text).encode("utf-8")
    assert tiny_vocab.decode_bytes(ids) == tiny_tokenizer.decode(ids).encode("utf-8") == expected


# ---------------------------------------------------------------- text before the container


@pytest.mark.parametrize(
    ("vocab_name", "fmt_name", "preamble", "after"),
    [
        ("tiny_vocab", "coordexp", "Sure: ", ""),
        ("fused", "coordexp", "Here you go:\n```json\n", "\n```"),
        ("stock_vocab", "qwen_relative", "```json\n", "\n```"),
        ("fused_plain", "qwen_pixels", "Boxes é: ", ""),
    ],
)
def test_preamble_is_kept_and_the_container_parsed(request, vocab_name, fmt_name, preamble, after):
    """Decision (as CoordExp): text before the opening bracket stays in the prefix as the rollout's own
    ids and the container after it is parsed."""
    vocab, fmt = request.getfixturevalue(vocab_name), FORMATS[fmt_name]
    cat, dog = DetObject("cat", "bbox_2d", (1, 2, 30, 40)), DetObject("dog", "bbox_2d", (500, 500, 999, 999))
    ids = list(vocab.encode(preamble + render([cat, dog], fmt) + after)) + [vocab.eos_id]
    parsed = parse(ids, vocab, fmt)
    check_invariants(ids, parsed, vocab, fmt)
    assert [o.obj for o in parsed.objects] == [cat, dog] and parsed.closed and parsed.n_dropped == 0
    text = vocab.decode_bytes(parsed.prefix_ids).decode()
    head, body = split_preamble(vocab.decode_bytes(parsed.prefix_ids))
    assert head == preamble.encode() and text == preamble + render([cat, dog], fmt)[:-1]
    assert parsed.n_own_prefix_ids >= len(vocab.encode(preamble)) - 1
    # Cut inside the second object: the preamble and the first object are kept.
    cut = list(vocab.encode(preamble + render([cat, dog], fmt)[:-12]))
    parsed = parse(cut, vocab, fmt)
    check_invariants(cut, parsed, vocab, fmt)
    assert [o.obj for o in parsed.objects] == [cat]
    assert vocab.decode_bytes(parsed.prefix_ids).decode() == preamble + render([cat], fmt)[:-1]
    # Nothing complete after the opener: the prefix is the preamble and the opener, all the rollout's own.
    opened = list(vocab.encode(preamble + render([cat], fmt)[:5]))
    parsed = parse(opened, vocab, fmt)
    assert parsed.objects == () and parsed.n_entries == 0 and parsed.truncated
    assert vocab.decode_bytes(parsed.prefix_ids).decode() == preamble + render([], fmt)[0]
    assert parsed.n_own_prefix_ids >= len(vocab.encode(preamble)) - 1  # at most a fused ` {` is re-encoded


@pytest.mark.parametrize(
    ("vocab_name", "fmt_name"), [("tiny_vocab", "coordexp"), ("tiny_vocab", "qwen_relative"), ("fused", "coordexp")]
)
def test_coord_or_special_token_before_the_container_ends_the_scan(request, vocab_name, fmt_name):
    vocab, fmt = request.getfixturevalue(vocab_name), FORMATS[fmt_name]
    answer = list(vocab.encode(render([DetObject("cat", "bbox_2d", (1, 2, 3, 4))], fmt))) + [vocab.eos_id]
    for bad in (vocab.coord_token_ids[7], min(vocab.special_ids)):
        ids = list(vocab.encode("Sure ")) + [bad] + answer
        parsed = parse(ids, vocab, fmt)
        check_invariants(ids, parsed, vocab, fmt)
        assert parsed.objects == () and parsed.n_own_prefix_ids == 0 and parsed.truncated
        assert vocab.decode_bytes(parsed.prefix_ids).decode() == render([], fmt)[0]  # the opener, parser-written


def test_the_other_bracket_ends_the_preamble(tiny_vocab, stock_vocab):
    # coordexp: `Sure! {"object_1": {}}` opens the object; its one entry is complete but invalid.
    parsed = parse(tiny_vocab.encode('Sure! {"object_1": {}}'), tiny_vocab)
    assert parsed.objects == () and parsed.n_dropped == 1 and parsed.closed
    assert tiny_vocab.decode_bytes(parsed.prefix_ids) == b'Sure! {"object_1": {}'
    # A `[` before the `{` is not a preamble: nothing of the rollout is kept.
    parsed = parse(tiny_vocab.encode('[{"object_1": {}}]'), tiny_vocab)
    assert parsed.n_own_prefix_ids == 0 and tiny_vocab.decode_bytes(parsed.prefix_ids) == b"{"
    # qwen_json: a bare object without its list is not mistaken for a list opened by its "bbox_2d": [.
    parsed = parse(stock_vocab.encode('Here: {"bbox_2d": [1, 2, 3, 4], "label": "cat"}'), stock_vocab, QWEN_JSON)
    assert parsed.objects == () and parsed.n_own_prefix_ids == 0
    assert stock_vocab.decode_bytes(parsed.prefix_ids) == b"["


# ---------------------------------------------------------------- polygons, reversed boxes, stripped descs


def _coord(k: int) -> str:
    return f'"<|coord_{k}|>"'


@pytest.mark.parametrize("vocab_name", ["tiny_vocab", "fused"])
def test_poly_as_pairs_or_flat(request, vocab_name):
    """CoordExp writes a poly as [x, y] pairs; a flat list is read too. Either way the coord token indices
    line up with the bins, so a matched polygon's coords get the coordinate loss."""
    vocab = request.getfixturevalue(vocab_name)
    tri = DetObject("red triangle", "poly", (10, 20, 30, 40, 50, 60))
    pairs = (
        '{"object_1": {"desc": "red triangle", "poly": [['
        + "], [".join(f"{_coord(x)}, {_coord(y)}" for x, y in ((10, 20), (30, 40), (50, 60)))
        + "]]}"
    )
    flat = '{"object_1": {"desc": "red triangle", "poly": [' + ", ".join(_coord(k) for k in tri.bins) + "]"
    assert COORDEXP.render([tri]) == pairs + "}"
    assert CoordExpFormat(polygons="flat").render([tri]) == flat + "}}"
    for text in (pairs + "}", flat + "}}"):
        ids = list(vocab.encode(text)) + [vocab.eos_id]
        parsed = parse(ids, vocab)
        check_invariants(ids, parsed, vocab)
        assert [o.obj for o in parsed.objects] == [tri]
        assert [vocab.coord_bin_of[ids[i]] for i in parsed.objects[0].coord_token_indices] == list(tri.bins)
    mixed = (
        '{"object_1": {"desc": "x", "poly": [['
        + _coord(1)
        + ", "
        + _coord(2)
        + "], "
        + _coord(3)
        + ", "
        + _coord(4)
        + ", "
        + _coord(5)
        + ", "
        + _coord(6)
        + "]}, "
        '"object_2": {"desc": "y", "poly": [['
        + _coord(1)
        + ", "
        + _coord(2)
        + ", "
        + _coord(3)
        + "], ["
        + _coord(4)
        + ", "
        + _coord(5)
        + ", "
        + _coord(6)
        + "]]}, "
        '"object_3": {"desc": "z", "bbox_2d": [['
        + _coord(1)
        + ", "
        + _coord(2)
        + "], ["
        + _coord(3)
        + ", "
        + _coord(4)
        + "]]}}"
    )
    ids = list(vocab.encode(mixed)) + [vocab.eos_id]
    parsed = parse(ids, vocab)
    check_invariants(ids, parsed, vocab)
    # Mixed forms, triples instead of pairs, and a box as pairs are all invalid: dropped, not repaired.
    assert parsed.objects == () and parsed.n_dropped == 3 and parsed.closed


def test_reversed_box_is_dropped_by_both_formats(tiny_vocab, stock_vocab):
    """Decision: a box with x2 < x1 or y2 < y1 is invalid (DetObject refuses it): dropped and counted,
    never repaired, never matched."""
    with pytest.raises(ValueError, match="reversed corners"):
        DetObject("cat", "bbox_2d", (50, 10, 40, 20))
    with pytest.raises(ValueError, match="reversed corners"):
        DetObject("cat", "bbox_2d", (10, 50, 40, 20))
    DetObject("line", "bbox_2d", (10, 10, 10, 20))  # zero width is a (degenerate) box, not a reversed one
    text = (
        '{"object_1": {"desc": "cat", "bbox_2d": [' + ", ".join(_coord(k) for k in (50, 10, 40, 20)) + "]}, "
        '"object_2": {"desc": "dog", "bbox_2d": [' + ", ".join(_coord(k) for k in (1, 2, 3, 4)) + "]}}"
    )
    ids = list(tiny_vocab.encode(text)) + [tiny_vocab.eos_id]
    parsed = parse(ids, tiny_vocab)
    check_invariants(ids, parsed, tiny_vocab)
    assert [o.obj.desc for o in parsed.objects] == ["dog"] and parsed.n_dropped == 1
    text = '[{"bbox_2d": [50, 10, 40, 20], "label": "cat"}, {"bbox_2d": [1, 20, 3, 10], "label": "cat"}]'
    ids = list(stock_vocab.encode(text)) + [stock_vocab.eos_id]
    parsed = parse(ids, stock_vocab, QWEN_JSON)
    check_invariants(ids, parsed, stock_vocab, QWEN_JSON)
    assert parsed.objects == () and parsed.n_dropped == 2 and parsed.closed


def test_desc_and_label_are_stripped(tiny_vocab, stock_vocab):
    """Decision: surrounding whitespace of a desc/label is not part of the name (DetObject strips it)."""
    assert DetObject(" cat\n", "bbox_2d", (1, 2, 3, 4)) == DetObject("cat", "bbox_2d", (1, 2, 3, 4))
    ids = list(
        tiny_vocab.encode(
            '{"object_1": {"desc": "  cat ", "bbox_2d": [' + ", ".join(_coord(k) for k in (1, 2, 3, 4)) + "]}}"
        )
    ) + [tiny_vocab.eos_id]
    assert [o.obj.desc for o in parse(ids, tiny_vocab).objects] == ["cat"]
    ids = list(stock_vocab.encode('[{"bbox_2d": [1, 2, 3, 4], "label": " cat "}]')) + [stock_vocab.eos_id]
    assert [o.obj.desc for o in parse(ids, stock_vocab, QWEN_JSON).objects] == ["cat"]
    # Blank after stripping is dropped.
    ids = list(stock_vocab.encode('[{"bbox_2d": [1, 2, 3, 4], "label": " \\t "}]')) + [stock_vocab.eos_id]
    assert parse(ids, stock_vocab, QWEN_JSON).n_dropped == 1


# ---------------------------------------------------------------- qwen_json specifics


def test_qwen_json_coord_tokens_inside_entries_invalidate_them(tiny_vocab):
    # A vocabulary with coord tokens, a format without: a coord id inside a label, or as a quoted
    # coordinate, drops the entry; outside any string it ends the scan.
    in_label = (
        tiny_vocab.encode('[{"bbox_2d": [1, 2, 3, 4], "label": "')
        + [tiny_vocab.coord_token_ids[3]]
        + tiny_vocab.encode('"}, {"bbox_2d": [1, 2, 3, 4], "label": "cat"}]')
        + [tiny_vocab.eos_id]
    )
    parsed = parse(in_label, tiny_vocab, QWEN_JSON)
    check_invariants(in_label, parsed, tiny_vocab, QWEN_JSON)
    assert [o.obj.desc for o in parsed.objects] == ["cat"] and parsed.n_dropped == 1
    bare = tiny_vocab.encode('[{"bbox_2d": [') + [tiny_vocab.coord_token_ids[3]] + tiny_vocab.encode(", 2, 3, 4]}]")
    parsed = parse(bare, tiny_vocab, QWEN_JSON)
    assert parsed.objects == () and parsed.truncated and parsed.n_entries == 0


def test_qwen_json_multiline_answer(stock_vocab):
    """Qwen-VL models often write the list one object per line, inside a ```json fence."""
    text = (
        '```json\n[\n\t{"bbox_2d": [10, 20, 300, 400], "label": "cat"},\n\t{"bbox_2d": [1, 2, 3], "label": "x"}\n]\n```'
    )
    ids = list(stock_vocab.encode(text)) + [stock_vocab.eos_id]
    parsed = parse(ids, stock_vocab, QWEN_JSON)
    check_invariants(ids, parsed, stock_vocab, QWEN_JSON)
    assert [o.obj for o in parsed.objects] == [DetObject("cat", "bbox_2d", (10, 20, 300, 400))]
    assert parsed.n_dropped == 1 and parsed.closed and parsed.max_object_index == 2


def test_pixel_format_on_a_small_image_is_a_fixed_point_after_one_trip(stock_vocab):
    """Under 1000 pixels a side several bins write as the same pixel; once written, it stays put."""
    fmt = QwenJsonFormat(coordinates="pixels").for_image(333, 250)
    objs = [DetObject("cat", "bbox_2d", (1, 2, 997, 999)), DetObject("dog", "bbox_2d", (100, 101, 500, 503))]
    once = [o.obj for o in parse(encode_answer(stock_vocab, objs, fmt), stock_vocab, fmt).objects]
    twice = [o.obj for o in parse(encode_answer(stock_vocab, once, fmt), stock_vocab, fmt).objects]
    assert len(once) == 2 and once == twice
    assert all(abs(a - b) <= 3 for o, p in zip(objs, once, strict=True) for a, b in zip(o.bins, p.bins, strict=True))


def test_coordexp_needs_coord_tokens(stock_vocab):
    with pytest.raises(ValueError, match="prepare-model.*qwen_json"):
        parse([1, 2, 3], stock_vocab, COORDEXP)
