"""learner/evaluation/draw.py: outlines land on the objects' edges in their colours, and pictures are written."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from learner.evaluation.draw import (
    GT_COLOUR,
    PRED_COLOUR,
    RolloutPicture,
    draw_detections,
    picture_name,
    save_rollout_pictures,
)

BG = (120, 120, 120)


def _layout(src: Image.Image, out: Image.Image) -> tuple[int, int]:
    """(scale, header height): the picture is the image upscaled by a whole factor under a header."""
    scale = out.width // src.width
    assert out.width == src.width * scale
    return scale, out.height - src.height * scale


def _near(out: Image.Image, x: float, y: float, colour: tuple[int, int, int], r: int = 1) -> bool:
    return any(out.getpixel((int(x) + dx, int(y) + dy)) == colour for dx in range(-r, r + 1) for dy in range(-r, r + 1))


def test_boxes_are_drawn_on_their_edges_in_their_colours() -> None:
    src = Image.new("RGB", (100, 80), BG)
    gt = [("red circle", "bbox_2d", [10, 10, 50, 40])]
    pred = [("red circle", "bbox_2d", [60, 20, 90, 70])]
    out = draw_detections(src, gt, pred, title="step 3")
    scale, header = _layout(src, out)
    assert scale == 4 and out.width >= 384  # small images are upscaled to be readable
    assert header > 0

    # Prediction: solid, every pixel along its bottom edge.
    px1, py1, px2, py2 = (v * scale for v in pred[0][2])
    for x in range(int(px1) + 4, int(px2) - 4, 3):
        assert _near(out, x, py2 + header, PRED_COLOUR), x
    assert _near(out, px1, (py1 + py2) / 2 + header, PRED_COLOUR)
    # Ground truth: dashed, so part (not all, not none) of its edge has the colour; corners are drawn.
    gx1, gy1, gx2, gy2 = (v * scale for v in gt[0][2])
    row = [out.getpixel((x, int(gy2 + header))) == GT_COLOUR for x in range(int(gx1), int(gx2))]
    assert 0.3 < sum(row) / len(row) < 0.8, sum(row) / len(row)
    for corner in ((gx1, gy1), (gx2, gy1), (gx2, gy2), (gx1, gy2)):
        assert _near(out, corner[0], corner[1] + header, GT_COLOUR, r=2), corner
    # Colours do not bleed: inside the boxes and away from labels the image is untouched.
    assert out.getpixel((int((gx1 + gx2) / 2), int((gy1 + gy2) / 2 + header))) == BG
    assert out.getpixel((int((px1 + px2) / 2), int((py1 + py2) / 2 + header))) == BG
    assert out.getpixel((int(95 * scale), int(75 * scale + header))) == BG
    assert GT_COLOUR not in {out.getpixel((x, int(py2 + header))) for x in range(int(px1), int(px2))}


def test_polygons_are_outlines_and_labels_are_written() -> None:
    src = Image.new("RGB", (100, 100), BG)
    tri = [20, 80, 50, 20, 80, 80]
    out = draw_detections(src, [], [("blue triangle", "poly", tri)])
    scale, header = _layout(src, out)
    # Midpoint of each edge is on the outline, the centroid stays unpainted.
    for (ax, ay), (bx, by) in (((20, 80), (50, 20)), ((50, 20), (80, 80)), ((80, 80), (20, 80))):
        assert _near(out, (ax + bx) / 2 * scale, (ay + by) / 2 * scale + header, PRED_COLOUR), (ax, ay, bx, by)
    assert out.getpixel((50 * scale, 60 * scale + header)) == BG
    # The label sits above the outline's top-left: a dark box with text in the prediction colour.
    label = out.crop((20 * scale, header, 80 * scale, 20 * scale + header))
    colours = {c for _n, c in label.getcolors(1 << 16)}
    text = [c for c in colours if c[0] > 150 and 50 < c[1] < 150 and c[2] < 40]  # antialiased orange glyphs
    assert (0, 0, 0) in colours and len(text) >= 3, colours


def test_large_images_keep_their_size_and_bad_geometry_is_refused() -> None:
    src = Image.new("RGB", (500, 400), BG)
    out = draw_detections(src, [("a", "bbox_2d", [10, 10, 20, 20])], [])
    assert _layout(src, out)[0] == 1
    with pytest.raises(ValueError, match="unknown geometry kind 'mask'"):
        draw_detections(src, [], [("a", "mask", [1, 2, 3, 4])])
    with pytest.raises(ValueError, match="bbox_2d needs 4 numbers, got 3"):
        draw_detections(src, [], [("a", "bbox_2d", [1, 2, 3])])


def test_save_rollout_pictures_writes_one_png_per_rollout(tmp_path: Path) -> None:
    src = Image.new("RGB", (96, 128), BG)
    items = [
        RolloutPicture(
            step=12,
            record_id="visual-3",
            image=src,
            ground_truth=[("a", "bbox_2d", [1, 1, 30, 30])],
            predicted=[("a", "bbox_2d", [2, 2, 31, 31])],
        ),
        RolloutPicture(step=12, record_id="visual-3", image=src, sample=1),
        RolloutPicture(step=12, record_id="a/b", image=src),
        RolloutPicture(step=12, record_id="a_b", image=src),
    ]
    paths = save_rollout_pictures(items, tmp_path / "pics")
    names = [p.name for p in paths]
    assert names[:2] == ["step000012-visual-3.png", "step000012-visual-3-s1.png"]
    assert "/" not in names[2] and names[2].startswith("step000012-a_b-") and names[3] == "step000012-a_b.png"
    assert len(set(names)) == 4 and all(p.parent == tmp_path / "pics" for p in paths)
    with Image.open(paths[0]) as pic:
        assert pic.format == "PNG" and pic.size[0] == 96 * 3 and pic.size[1] > 128 * 3  # long side 128 -> x3
        assert PRED_COLOUR in {c for _n, c in pic.convert("RGB").getcolors(1 << 20)}
    assert picture_name(7, "x", 2) == "step000007-x-s2.png"
