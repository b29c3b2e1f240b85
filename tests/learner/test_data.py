from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.data import DataError, load_records
from learner.synthetic import write_synthetic_dataset


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
        (json.dumps({"id": "x", "width": 0, "height": 10, "messages": [{"role": "user", "content": "a"}]}),
         "width"),
        (json.dumps({"id": "x", "width": 10, "height": 10, "messages": [{"role": "user", "content": "a"}],
                     "objects": [{"desc": "a", "bbox_2d": [1, 2, 3]}]}), "objects.0: Value error, bbox_2d needs 4"),
        (json.dumps({"id": "x", "width": 10, "height": 10, "messages": [{"role": "user", "content": "a"}],
                     "objects": [{"desc": "a", "bbox_2d": [1, 2, 3, 4], "poly": [1, 2, 3, 4, 5, 6]}]}),
         "exactly one of bbox_2d or poly"),
        (json.dumps({"id": "x", "width": 10, "height": 10, "messages": [{"role": "user", "content": "a"}],
                     "objects": [{"desc": "", "poly": [1, 2, 3, 4, 5, 6]}]}), "objects.0.desc"),
        (json.dumps({"id": "x", "width": 10, "height": 10, "messages": [{"role": "bot", "content": "a"}]}),
         "messages.0.role"),
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
