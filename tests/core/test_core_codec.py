"""CoordExp format: grid conversion, rendering, strict validation."""

from __future__ import annotations

import json

import pytest

from learner.core.codec import COORDEXP, DetObject, bin_to_pixel, coord_bin_from_text, pixel_to_bin


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
    ],
)
def test_strict_validation_rejects(key, value):
    assert COORDEXP.validate_entry(key, value) is None


def test_coord_text():
    assert coord_bin_from_text("<|coord_0|>") == 0 and coord_bin_from_text("<|coord_999|>") == 999
    assert coord_bin_from_text(" <|coord_1|>") is None and coord_bin_from_text("<|coord_-1|>") is None
