"""Output formats (coordexp, qwen_json): grid conversion, rendering, strict validation, the factory the
job spec's `training.format` goes through, and the vocabulary's coord tokens."""

from __future__ import annotations

import json

import pytest

from learner.core.codec import (
    COORDEXP,
    QWEN_JSON,
    CoordExpFormat,
    DetObject,
    FormatError,
    QwenJsonFormat,
    bin_to_pixel,
    coord_bin_from_text,
    output_format,
    pixel_to_bin,
)
from learner.core.vocab import VocabView


def test_pixel_bin_conversion():
    assert pixel_to_bin(0, 640) == 0
    assert pixel_to_bin(320, 640) == 500
    assert pixel_to_bin(640, 640) == 999  # round(1000) clamped to the last bin
    assert pixel_to_bin(-5, 640) == 0
    assert pixel_to_bin(0.3, 1000) == 0 and pixel_to_bin(0.6, 1000) == 1
    for k in (0, 1, 499, 998):
        assert pixel_to_bin(bin_to_pixel(k, 1333), 1333) == k
    obj = DetObject.from_pixels("cat", "bbox_2d", [64, 48, 640, 480], width=640, height=480)
    assert obj.bins == (100, 100, 999, 999)
    with pytest.raises(ValueError, match="positive"):
        pixel_to_bin(1, 0)


def test_render_is_single_line_json_with_coord_tokens():
    objs = [DetObject('a "b"', "bbox_2d", (1, 2, 3, 4)), DetObject("café", "poly", (0, 0, 9, 0, 9, 9))]
    text = COORDEXP.render(objs)
    assert "\n" not in text
    assert text.startswith('{"object_1": {"desc": "a \\"b\\"", "bbox_2d": ["<|coord_1|>", "<|coord_2|>"')
    data = json.loads(text)
    assert list(data) == ["object_1", "object_2"]
    assert [COORDEXP.validate_entry(k, v) for k, v in data.items()] == objs
    assert COORDEXP.render_entries(objs[:1], 7).startswith('"object_7": {"desc"')
    spans = COORDEXP.desc_value_spans(COORDEXP.render_entries(objs, 1))
    assert [COORDEXP.render_entries(objs, 1)[s:e] for s, e in spans] == ['a \\"b\\"', "café"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("object_0", {"desc": "x", "bbox_2d": ["<|coord_1|>"] * 4}),
        ("object_01", {"desc": "x", "bbox_2d": ["<|coord_1|>"] * 4}),
        ("obj_1", {"desc": "x", "bbox_2d": ["<|coord_1|>"] * 4}),
        ("object_1", {"desc": "", "bbox_2d": ["<|coord_1|>"] * 4}),
        ("object_1", {"desc": "  ", "bbox_2d": ["<|coord_1|>"] * 4}),
        ("object_1", {"desc": 5, "bbox_2d": ["<|coord_1|>"] * 4}),
        ("object_1", {"desc": "x", "bbox_2d": ["<|coord_1|>"] * 3}),
        ("object_1", {"desc": "x", "bbox_2d": [1, 2, 3, 4]}),
        ("object_1", {"desc": "x", "bbox_2d": ["<|coord_1000|>"] * 4}),
        ("object_1", {"desc": "x", "bbox_2d": ["<|coord_01|>"] * 4}),
        ("object_1", {"desc": "x", "poly": ["<|coord_1|>"] * 4}),
        ("object_1", {"desc": "x", "poly": ["<|coord_1|>"] * 7}),
        ("object_1", {"desc": "x", "bbox_2d": ["<|coord_1|>"] * 4, "poly": ["<|coord_1|>"] * 6}),
        ("object_1", {"desc": "x", "bbox_2d": ["<|coord_1|>"] * 4, "score": 1}),
        ("object_1", {"desc": "<|coord_3|>", "bbox_2d": ["<|coord_1|>"] * 4}),
        ("object_1", ["desc"]),
        (None, {"desc": "x", "bbox_2d": ["<|coord_1|>"] * 4}),
        ("object_1", {"desc": "x", "bbox_2d": ["<|coord_5|>", "<|coord_1|>", "<|coord_4|>", "<|coord_9|>"]}),
        ("object_1", {"desc": "x", "bbox_2d": [["<|coord_1|>", "<|coord_2|>"], ["<|coord_3|>", "<|coord_4|>"]]}),
        ("object_1", {"desc": "x", "poly": [["<|coord_1|>", "<|coord_2|>", "<|coord_3|>"]] * 2}),
        ("object_1", {"desc": "x", "poly": [["<|coord_1|>", "<|coord_2|>"]] * 2 + ["<|coord_1|>", "<|coord_2|>"]}),
        ("object_1", {"desc": "x", "poly": [["<|coord_1|>", "<|coord_2|>"]] * 2}),
        ("object_1", {"desc": "x", "poly": [["<|coord_1|>", 2]] * 3}),
        ("object_1", {"desc": "x", "poly": []}),
    ],
)
def test_strict_validation_rejects(key, value):
    assert COORDEXP.validate_entry(key, value) is None


def test_coord_text():
    assert coord_bin_from_text("<|coord_0|>") == 0 and coord_bin_from_text("<|coord_999|>") == 999
    assert coord_bin_from_text(" <|coord_1|>") is None and coord_bin_from_text("<|coord_-1|>") is None


def test_coordexp_poly_pairs_and_flat():
    tri = DetObject("t", "poly", (1, 2, 3, 4, 5, 6))
    pairs = COORDEXP.render([tri])
    assert (
        '"poly": [["<|coord_1|>", "<|coord_2|>"], ["<|coord_3|>", "<|coord_4|>"], ["<|coord_5|>", "<|coord_6|>"]]'
    ) in pairs
    flat = CoordExpFormat(polygons="flat").render([tri])
    assert '"poly": ["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>", "<|coord_5|>", "<|coord_6|>"]' in flat
    for text in (pairs, flat):  # each is read by either setting: the option only picks what is written
        for fmt in (COORDEXP, CoordExpFormat(polygons="flat")):
            assert [fmt.validate_entry(k, v) for k, v in json.loads(text).items()] == [tri]


def test_det_object_rules():
    assert DetObject("  cat \n", "bbox_2d", [1, 2, 3, 4]) == DetObject("cat", "bbox_2d", (1, 2, 3, 4))
    assert DetObject("cat", "bbox_2d", [1, 2, 3, 4]).bins == (1, 2, 3, 4)  # hashable whatever it was given
    for bad, match in [
        (("  ", "bbox_2d", (1, 2, 3, 4)), "blank"),
        (("a<|coord_1|>", "bbox_2d", (1, 2, 3, 4)), "coord"),
        (("a", "bbox_2d", (1, 2, 0, 4)), "reversed"),
        (("a", "bbox_2d", (1, 5, 3, 4)), "reversed"),
        (("a", "bbox_2d", (True, 2, 3, 4)), "outside"),
        (("a", "bbox_2d", (1.0, 2, 3, 4)), "outside"),
        ((5, "bbox_2d", (1, 2, 3, 4)), "string"),
    ]:
        with pytest.raises(ValueError, match=match):
            DetObject(*bad)
    tri = DetObject("t", "poly", (500, 10, 900, 700, 100, 400))
    assert tri.enclosing_box() == DetObject("t", "bbox_2d", (100, 10, 900, 700))


# ---------------------------------------------------------------- qwen_json


def test_qwen_json_render_relative():
    objs = [DetObject("cat", "bbox_2d", (0, 12, 500, 999)), DetObject('a "b"', "poly", (500, 10, 900, 700, 100, 400))]
    text = QWEN_JSON.render(objs)
    # Qwen-VL's own answer shape, single line; a polygon is written as its enclosing box.
    assert text == (
        '[{"bbox_2d": [0, 12, 500, 999], "label": "cat"}, {"bbox_2d": [100, 10, 900, 700], "label": "a \\"b\\""}]'
    )
    assert [QWEN_JSON.validate_entry(None, v) for v in json.loads(text)] == [QWEN_JSON.as_written(o) for o in objs]
    entries = QWEN_JSON.render_entries(objs, 7)  # a list has no keys: the start index is irrelevant
    assert entries == text[1:-1]
    assert [entries[s:e] for s, e in QWEN_JSON.desc_value_spans(entries)] == ["cat", 'a \\"b\\"']
    # 1000 is Qwen's right/bottom edge: it reads as the last bin.
    assert QWEN_JSON.validate_entry(None, {"bbox_2d": [0, 0, 1000, 1000], "label": "x"}).bins == (0, 0, 999, 999)
    assert QWEN_JSON.for_image(640, 480) is QWEN_JSON and COORDEXP.for_image(640, 480) is COORDEXP


def test_qwen_json_pixels_bind_to_the_resized_image():
    unbound = QwenJsonFormat(coordinates="pixels")
    cat = DetObject("cat", "bbox_2d", (100, 250, 500, 999))
    with pytest.raises(FormatError, match="for_image"):
        unbound.render([cat])
    with pytest.raises(FormatError, match="for_image"):
        unbound.validate_entry(None, {"bbox_2d": [1, 2, 3, 4], "label": "x"})
    fmt = unbound.for_image(640, 480)
    assert fmt.width == 640 and fmt.height == 480 and unbound.width is None
    text = fmt.render([cat])
    assert text == '[{"bbox_2d": [64, 120, 320, 480], "label": "cat"}]'
    assert fmt.validate_entry(None, json.loads(text)[0]) == cat
    assert fmt.validate_entry(None, {"bbox_2d": [0, 0, 640, 480], "label": "x"}).bins == (0, 0, 999, 999)
    assert fmt.validate_entry(None, {"bbox_2d": [0, 0, 641, 480], "label": "x"}) is None  # outside the image
    assert fmt.validate_entry(None, {"bbox_2d": [0, 0, 640, 481], "label": "x"}) is None
    with pytest.raises(FormatError, match="positive"):
        unbound.for_image(0, 480)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("object_1", {"bbox_2d": [1, 2, 3, 4], "label": "x"}),
        (None, {"bbox_2d": [1, 2, 3, 4]}),
        (None, {"bbox_2d": [1, 2, 3, 4], "label": "x", "score": 0.9}),
        (None, {"bbox_2d": [1, 2, 3, 4], "desc": "x"}),
        (None, {"poly": [1, 2, 3, 4, 5, 6], "label": "x"}),
        (None, {"bbox_2d": [1, 2, 3], "label": "x"}),
        (None, {"bbox_2d": [1, 2, 3, 4, 5], "label": "x"}),
        (None, {"bbox_2d": [1.0, 2, 3, 4], "label": "x"}),
        (None, {"bbox_2d": [True, 2, 3, 4], "label": "x"}),
        (None, {"bbox_2d": ["1", 2, 3, 4], "label": "x"}),
        (None, {"bbox_2d": [-1, 2, 3, 4], "label": "x"}),
        (None, {"bbox_2d": [1, 2, 3, 1001], "label": "x"}),
        (None, {"bbox_2d": [5, 2, 3, 4], "label": "x"}),
        (None, {"bbox_2d": [[1, 2], [3, 4]], "label": "x"}),
        (None, {"bbox_2d": "1, 2, 3, 4", "label": "x"}),
        (None, {"bbox_2d": [1, 2, 3, 4], "label": " "}),
        (None, {"bbox_2d": [1, 2, 3, 4], "label": ""}),
        (None, {"bbox_2d": [1, 2, 3, 4], "label": 7}),
        (None, {"bbox_2d": [1, 2, 3, 4], "label": "<|coord_1|>"}),
        (None, [1, 2, 3, 4]),
    ],
)
def test_qwen_json_strict_validation_rejects(key, value):
    assert QWEN_JSON.validate_entry(key, value) is None


def test_output_format_factory():
    assert output_format("coordexp") == COORDEXP
    assert output_format("coordexp", polygons="flat") == CoordExpFormat(polygons="flat")
    assert output_format("qwen_json") == QWEN_JSON
    assert output_format("qwen_json", coordinates="pixels") == QwenJsonFormat(coordinates="pixels")
    # Each option belongs to one format; the other ignores it.
    assert output_format("coordexp", coordinates="pixels") == COORDEXP
    assert output_format("qwen_json", polygons="flat") == QWEN_JSON
    assert (COORDEXP.container, COORDEXP.coord_tokens) == ("object", True)
    assert (QWEN_JSON.container, QWEN_JSON.coord_tokens) == ("list", False)
    for kwargs, key in [
        ({"name": "qwen"}, "training.format:"),
        ({"name": "qwen_json", "coordinates": "abs"}, "training.format_options.coordinates:"),
        ({"name": "coordexp", "polygons": "rings"}, "training.format_options.polygons:"),
    ]:
        with pytest.raises(FormatError, match=key):
            output_format(**kwargs)


# ---------------------------------------------------------------- coord tokens in the vocabulary


def test_vocab_view_with_or_without_coord_tokens(stock_tokenizer, tiny_tokenizer):
    with pytest.raises(ValueError, match=r"rmsft prepare-model.*training.format: qwen_json"):
        VocabView.from_hf_tokenizer(stock_tokenizer)
    plain = VocabView.from_hf_tokenizer(stock_tokenizer, coord_tokens=False)
    assert plain.coord_token_ids == () and plain.coord_bin_of == {} and not plain.has_coord_tokens
    full = VocabView.from_hf_tokenizer(tiny_tokenizer)
    assert len(full.coord_token_ids) == 1000 and full.has_coord_tokens
    # A tokenizer that has them, for a format that does not use them: they are not looked up.
    assert VocabView.from_hf_tokenizer(tiny_tokenizer, coord_tokens=False).coord_token_ids == ()
    with pytest.raises(ValueError, match="1000 coord token ids or none"):
        VocabView(coord_token_ids=tuple(range(500)), token_bytes=(b"a",) * 600, encode=list, eos_id=0)
