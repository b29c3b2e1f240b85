"""The synthetic visual task: deterministic files, records that validate, and ground truth that
matches the rendered pixels (so a model can only score by looking at the image)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from learner.data.dataset import load_dataset
from learner.data.records import Record
from rmsft_dev.synthetic import VISUAL_CLASS_NAMES, VISUAL_COLOURS, VISUAL_SHAPES, write_visual_dataset

N = 64


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_visual_dataset(tmp_path_factory.mktemp("visual") / "train.jsonl", n=N, seed=0)


@pytest.fixture(scope="module")
def records(dataset: Path) -> list[Record]:
    records, _store = load_dataset(dataset, None, 50_000_000)
    return records


def _image(dataset: Path, record: Record) -> Image.Image:
    (ref,) = record.images
    return Image.open(dataset.parent / ref).convert("RGB")


def _box(obj) -> tuple[float, float, float, float]:
    if obj.bbox_2d is not None:
        return tuple(obj.bbox_2d)
    xs, ys = obj.poly[0::2], obj.poly[1::2]
    return min(xs), min(ys), max(xs), max(ys)


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return min(a[2], b[2]) > max(a[0], b[0]) and min(a[3], b[3]) > max(a[1], b[1])


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_other_images(tmp_path: Path) -> None:
    write_visual_dataset(tmp_path / "a" / "d.jsonl", n=12, seed=5)
    write_visual_dataset(tmp_path / "b" / "d.jsonl", n=12, seed=5)
    write_visual_dataset(tmp_path / "c" / "d.jsonl", n=12, seed=6)
    a, b, c = (_files(tmp_path / x) for x in "abc")
    assert len(a) == 13 and a.keys() == b.keys() == c.keys()  # 12 PNGs and the JSONL
    assert a == b
    assert a["d.jsonl"] != c["d.jsonl"]
    assert sum(a[k] != c[k] for k in a if k.endswith(".png")) >= 10


def test_records_validate_with_paths_relative_to_the_dataset(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # resolution must not depend on the working directory
    records, store = load_dataset(dataset, None, 50_000_000)
    assert len(records) == N
    for r in records:
        (ref,) = r.images
        assert not Path(ref).is_absolute() and ref.startswith("train-images/")
        (loaded,) = store.load(r)
        assert (loaded.width, loaded.height) == (r.width, r.height)


def test_sizes_vary_within_the_token_budget(records: list[Record]) -> None:
    sizes = {(r.width, r.height) for r in records}
    assert all(96 <= w <= 256 and 96 <= h <= 256 for w, h in sizes)
    assert sum(w != h for w, h in sizes) > N // 2  # mostly not square
    assert max(w for w, _ in sizes) - min(w for w, _ in sizes) > 100


def test_objects_are_the_small_class_set_with_the_right_geometry(records: list[Record]) -> None:
    assert len(VISUAL_CLASS_NAMES) == len(VISUAL_COLOURS) * len(VISUAL_SHAPES) == 9
    seen = set()
    counts = []
    for r in records:
        counts.append(len(r.objects))
        for o in r.objects:
            seen.add(o.desc)
            assert o.desc in VISUAL_CLASS_NAMES
            if o.desc.endswith("triangle"):
                assert o.bbox_2d is None and len(o.poly) == 6
            else:
                assert o.poly is None and len(o.bbox_2d) == 4
            x1, y1, x2, y2 = _box(o)
            assert 0 <= x1 < x2 <= r.width and 0 <= y1 < y2 <= r.height, (r.id, o)
            # large: at least ~1/5 of the image's shorter side
            assert min(x2 - x1, y2 - y1) >= 0.18 * min(r.width, r.height), (r.id, o)
    assert seen == set(VISUAL_CLASS_NAMES)
    assert set(counts) == {1, 2, 3}


def test_some_objects_overlap(records: list[Record]) -> None:
    pairs = sum(
        _overlap(_box(a), _box(b)) for r in records for i, a in enumerate(r.objects) for b in r.objects[i + 1 :]
    )
    assert pairs >= 3


def test_prompts_do_not_give_the_answer_away(records: list[Record]) -> None:
    for r in records:
        text = " ".join(m.content for m in r.messages).lower()
        assert not re.search(r"\d|\[", text.replace("bbox_2d", "")), text  # no number, no coordinate list
        assert not any(word in text for word in (*VISUAL_COLOURS, "circle", "rectangle", "triangle")), text


def test_every_object_shows_its_colour_where_it_lies(dataset: Path, records: list[Record]) -> None:
    """The generator keeps each object's centre uncovered: the pixel there has the object's colour."""
    for r in records:
        img = _image(dataset, r)
        for o in r.objects:
            if o.poly is not None:
                cx, cy = round(sum(o.poly[0::2]) / 3), round(sum(o.poly[1::2]) / 3)
            else:
                x1, y1, x2, y2 = o.bbox_2d
                cx, cy = (x1 + x2) // 2, (y1 + y2) // 2
            assert img.getpixel((cx, cy)) == VISUAL_COLOURS[o.desc.split()[0]], (r.id, o)


def test_boxes_are_tight_around_isolated_shapes(dataset: Path, records: list[Record]) -> None:
    """For an object overlapping no other, the pixels of its colour around it span exactly its box."""
    checked = 0
    for r in records:
        img = _image(dataset, r)
        for i, o in enumerate(r.objects):
            box = _box(o)
            if any(_overlap(box, _box(other)) for j, other in enumerate(r.objects) if j != i):
                continue
            colour = VISUAL_COLOURS[o.desc.split()[0]]
            x1, y1, x2, y2 = (int(v) for v in box)
            xs, ys = [], []
            for y in range(max(0, y1 - 3), min(r.height, y2 + 3)):
                for x in range(max(0, x1 - 3), min(r.width, x2 + 3)):
                    if img.getpixel((x, y)) == colour:
                        xs.append(x)
                        ys.append(y)
            if o.poly is not None:  # polygon vertices are pixel positions: filled from x1 to x2 inclusive
                assert abs(min(xs) - x1) <= 1 and abs(max(xs) - x2) <= 1, (r.id, o)
                assert abs(min(ys) - y1) <= 1 and abs(max(ys) - y2) <= 1, (r.id, o)
            else:  # boxes are pixel edges: the shape fills x1 .. x2-1
                assert (min(xs), min(ys), max(xs) + 1, max(ys) + 1) == (x1, y1, x2, y2), (r.id, o)
            checked += 1
    assert checked >= N


def test_record_sizes_are_the_image_sizes(dataset: Path, records: list[Record]) -> None:
    raw = [json.loads(line) for line in dataset.read_text().splitlines()]
    for line, r in zip(raw, records, strict=True):
        with Image.open(dataset.parent / r.images[0]) as im:
            assert im.size == (line["width"], line["height"]) and im.format == "PNG"


def test_qwen_json_instruction_same_records(tmp_path: Path) -> None:
    """`fmt` changes the instruction only: the same images and objects, asked for in Qwen-VL's own format."""
    from rmsft_dev.synthetic import VISUAL_PROMPT, VISUAL_PROMPT_QWEN_JSON

    coordexp = write_visual_dataset(tmp_path / "c.jsonl", n=4, seed=1)
    qwen = write_visual_dataset(tmp_path / "q.jsonl", n=4, seed=1, fmt="qwen_json")
    for a, b in zip(coordexp.read_text().splitlines(), qwen.read_text().splitlines(), strict=True):
        ra, rb = json.loads(a), json.loads(b)
        assert ra["messages"][0]["content"] == VISUAL_PROMPT and rb["messages"][0]["content"] == VISUAL_PROMPT_QWEN_JSON
        assert ra["objects"] == rb["objects"] and ra["width"] == rb["width"]
    assert "label" in VISUAL_PROMPT_QWEN_JSON and "desc" not in VISUAL_PROMPT_QWEN_JSON
    assert not re.search(r"\d|\[", VISUAL_PROMPT_QWEN_JSON.lower().replace("bbox_2d", ""))
    assert not any(w in VISUAL_PROMPT_QWEN_JSON for w in (*VISUAL_COLOURS, "circle", "rectangle", "triangle"))
    with pytest.raises(ValueError, match="fmt"):
        write_visual_dataset(tmp_path / "x.jsonl", n=1, fmt="yolo")  # type: ignore[arg-type]


def test_row_layout_is_a_row_of_same_label_neighbours_drawn_where_the_boxes_say(tmp_path: Path) -> None:
    """The benchmark's row setting (studies/method/method_compare.py): 3-6 same-label tall rectangles in adjacent
    columns, each a shape of its own in the pixels (a gap between neighbours), other shapes elsewhere."""
    path = write_visual_dataset(
        tmp_path / "row.jsonl", n=24, seed=5, layout="row", cells=6, min_row=3, max_row=6, max_others=2
    )
    records, _store = load_dataset(path, None, 50_000_000)
    lengths = set()
    for record in records:
        boxes = [tuple(o.bbox_2d) for o in record.objects]
        assert boxes == sorted(boxes, key=lambda b: (b[1], b[0]))  # reading order
        label, n = max(
            ((d, sum(o.desc == d for o in record.objects)) for d in {o.desc for o in record.objects}),
            key=lambda dn: dn[1],
        )
        row = sorted(tuple(o.bbox_2d) for o in record.objects if o.desc == label)
        assert 3 <= n <= 6 and label.endswith("rectangle")
        lengths.add(n)
        # Side by side: one column each, same top and bottom, each starting where the last ends.
        assert all(b[2] - b[0] == 32 and b[3] - b[1] in (64, 96) for b in row)
        assert len({(b[1], b[3]) for b in row}) == 1
        assert all(nxt[0] == prev[2] for prev, nxt in zip(row, row[1:], strict=False))
        others = [o for o in record.objects if o.desc != label]
        assert len(others) <= 2 and not any(_overlap(tuple(o.bbox_2d), b) for o in others for b in row)
        img = _image(path, record)
        colour = VISUAL_COLOURS[label.split()[0]]
        for b in row:  # the shape's colour inside its box, the background in the gap before its right edge
            assert img.getpixel((b[0] + 16, (b[1] + b[3]) // 2)) == colour
            assert img.getpixel((b[2] - 1, (b[1] + b[3]) // 2)) != colour
    assert len(lengths) >= 3  # rows of several lengths, not one
    again = write_visual_dataset(
        tmp_path / "again" / "row.jsonl", n=24, seed=5, layout="row", cells=6, min_row=3, max_row=6, max_others=2
    )
    assert again.read_text() == path.read_text()
