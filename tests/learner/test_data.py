from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.data.records import DataError, load_records
from rmsft_dev.synthetic import write_synthetic_dataset


def _rec(objects: list[dict]) -> str:
    return json.dumps(
        {"id": "x", "width": 10, "height": 10, "messages": [{"role": "user", "content": "a"}], "objects": objects}
    )


def test_synthetic_dataset_loads_and_is_deterministic(tmp_path: Path) -> None:
    a = write_synthetic_dataset(tmp_path / "a.jsonl", n=20, seed=3)
    b = write_synthetic_dataset(tmp_path / "b.jsonl", n=20, seed=3)
    assert a.read_text() == b.read_text()
    records = load_records(a)
    assert len(records) == 20
    for r in records:
        assert r.objects
        for o in r.objects:
            x1, y1, x2, y2 = o.bbox_2d
            assert 0 <= x1 <= x2 <= r.width and 0 <= y1 <= y2 <= r.height


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", ":2: not valid JSON"),
        (json.dumps({"id": "x", "width": 10, "height": 10, "messages": []}), "messages"),
        (json.dumps({"id": "x", "width": 0, "height": 10, "messages": [{"role": "user", "content": "a"}]}), "width"),
        (
            json.dumps(
                {
                    "id": "x",
                    "width": 10,
                    "height": 10,
                    "messages": [{"role": "user", "content": "a"}],
                    "objects": [{"desc": "a", "bbox_2d": [1, 2, 3]}],
                }
            ),
            "objects.0: Value error, bbox_2d needs 4",
        ),
        (
            json.dumps(
                {
                    "id": "x",
                    "width": 10,
                    "height": 10,
                    "messages": [{"role": "user", "content": "a"}],
                    "objects": [{"desc": "a", "bbox_2d": [1, 2, 3, 4], "poly": [1, 2, 3, 4, 5, 6]}],
                }
            ),
            "exactly one of bbox_2d or poly",
        ),
        (
            json.dumps(
                {
                    "id": "x",
                    "width": 10,
                    "height": 10,
                    "messages": [{"role": "user", "content": "a"}],
                    "objects": [{"desc": "", "poly": [1, 2, 3, 4, 5, 6]}],
                }
            ),
            "objects.0.desc",
        ),
        (
            json.dumps({"id": "x", "width": 10, "height": 10, "messages": [{"role": "bot", "content": "a"}]}),
            "messages.0.role",
        ),
        # Object rules of the core, applied at load so the error names the line and the field:
        (
            _rec([{"desc": "a", "bbox_2d": [1, 2, 3, 4]}, {"desc": " \t ", "bbox_2d": [1, 2, 3, 4]}]),
            ":2: objects.1.desc: Value error, object desc must not be blank",
        ),
        (
            _rec([{"desc": "cat <|coord_12|>", "poly": [1, 2, 3, 4, 5, 6]}]),
            ":2: objects.0.desc: Value error, object desc must not contain coordinate-token text",
        ),
        (
            _rec([{"desc": "a", "bbox_2d": [5, 2, 3, 4]}]),
            ":2: objects.0: Value error, bbox_2d [5.0, 2.0, 3.0, 4.0] has x2 < x1 or y2 < y1",
        ),
        (
            _rec([{"desc": "a", "bbox_2d": [1, 2, 3, 4]}]).replace("4]", "NaN]"),
            ":2: objects.0.bbox_2d.3: Input should be a finite number",
        ),
    ],
)
def test_bad_lines_name_line_and_field(tmp_path: Path, line: str, expected: str) -> None:
    good = json.dumps({"id": "ok", "width": 10, "height": 10, "messages": [{"role": "user", "content": "a"}]})
    path = tmp_path / "d.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(DataError) as err:
        load_records(path)
    assert expected in str(err.value)
    assert str(path) in str(err.value)


def test_missing_empty_and_duplicate(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no records"):
        load_records(tmp_path / "empty.jsonl")
    rec = json.dumps({"id": "x", "width": 10, "height": 10, "messages": [{"role": "user", "content": "a"}]})
    (tmp_path / "dup.jsonl").write_text(rec + "\n" + rec + "\n")
    with pytest.raises(DataError, match="duplicate record id 'x'"):
        load_records(tmp_path / "dup.jsonl")


def test_gzip_dataset_loads_and_a_misnamed_one_is_named(tmp_path: Path) -> None:
    """spec.training.data.path accepts .jsonl.gz: the loader reads it as the plain file."""
    import gzip

    lines = [
        json.dumps(
            {
                "id": f"r{i}",
                "width": 10,
                "height": 10,
                "messages": [{"role": "user", "content": "a"}],
                "objects": [{"desc": "cat", "bbox_2d": [1, 1, 5, 5]}],
            }
        )
        for i in range(3)
    ]
    packed = tmp_path / "train.jsonl.gz"
    packed.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    assert [r.id for r in load_records(packed)] == ["r0", "r1", "r2"]
    # Compressed bytes under a plain name, and a cut gzip file: one clear line each, no traceback.
    (tmp_path / "misnamed.jsonl").write_bytes(packed.read_bytes())
    with pytest.raises(DataError, match=r"misnamed.jsonl:1: not UTF-8 text .* needs the .gz suffix"):
        load_records(tmp_path / "misnamed.jsonl")
    (tmp_path / "cut.jsonl.gz").write_bytes(packed.read_bytes()[:20])
    with pytest.raises(DataError, match="cut.jsonl.gz: not a complete gzip file"):
        load_records(tmp_path / "cut.jsonl.gz")


def test_descs_load_as_written_and_reach_the_core_stripped(tmp_path: Path) -> None:
    from learner.core.codec import COORDEXP, QWEN_JSON, DetObject
    from learner.data.episode import ground_truth

    path = tmp_path / "d.jsonl"
    path.write_text(
        _rec([{"desc": " cat ", "bbox_2d": [1, 2, 3, 4]}, {"desc": "tri", "poly": [0, 0, 10, 0, 5, 5]}]) + "\n"
    )
    (record,) = load_records(path)
    assert record.objects[0].desc == " cat "
    gt = ground_truth(record)
    assert gt[0] == DetObject("cat", "bbox_2d", (100, 200, 300, 400)) and gt[1].kind == "poly"
    assert ground_truth(record, COORDEXP) == gt
    # qwen_json writes boxes only: ground truth polygons are matched and appended as their enclosing box.
    assert ground_truth(record, QWEN_JSON) == [gt[0], DetObject("tri", "bbox_2d", (0, 0, 999, 500))]
