"""studies/method/box_errors.py: where a grid's boxes go wrong, read from its detections ledger (pure, no model)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from benchmark_module import load_study


def _module():
    return load_study("box_errors")


# Two tall same-label neighbours (one cell of 32 px wide, two tall) and a one-cell shape of another label.
TRUTH = [["red rectangle", 0, 0, 32, 64], ["red rectangle", 32, 0, 64, 64], ["blue circle", 96, 96, 128, 128]]


def test_each_prediction_pairs_once_in_the_order_written_and_its_edge_errors_are_kept() -> None:
    be = _module()
    predicted = [
        ["red rectangle", 0, 0, 32, 96],  # the first neighbour drawn a cell too tall: IoU 2/3, y2 +32
        ["red rectangle", 0, 0, 32, 64],  # the first neighbour again, exact: its object is taken, the other is not hit
        ["red rectangle", 32, 0, 64, 64],  # the second neighbour, exact
        ["green circle", 96, 96, 128, 128],  # right place, wrong label: no pair
    ]
    got = be.pairs(TRUTH, predicted)
    assert [round(p[0], 4) for p in got] == [round(2 / 3, 4), 1.0]
    assert got[0][1] == [0, 0, 0, 32] and got[1][1] == [0, 0, 0, 0]
    assert [p[2] for p in got] == [True, True]
    s = be.summary(got + be.pairs(TRUTH, [["blue circle", 96, 96, 128, 129]]))
    assert s["pairs"] == 3 and s["iou75"] == pytest.approx(2 / 3)
    assert s["tall"]["pairs"] == 2 and s["other"]["pairs"] == 1
    assert s["tall"]["y2"]["signed"] == pytest.approx(16.0) and s["tall"]["y2"]["abs"] == pytest.approx(16.0)
    assert sorted(s["tall"]["y2"]["common"]) == [(0, 1), (32, 1)]
    assert s["other"]["y2"]["signed"] == pytest.approx(1.0)


def test_the_ledger_is_read_per_setting_and_arm_and_a_later_run_replaces_an_earlier_one(tmp_path: Path, capsys) -> None:
    be = _module()
    path = tmp_path / "g-detections.jsonl.gz"

    def line(arm: str, seed: int, predicted: list) -> str:
        return (
            json.dumps(
                {
                    "key": ["row", arm, seed, 40, 20, 1, 0.0],
                    "step": 40,
                    "sizes": [[192, 192]],
                    "truth": [TRUTH],
                    "predicted": [predicted],
                }
            )
            + "\n"
        )

    with gzip.open(path, "wt") as f:
        f.write(line("sft", 0, [["red rectangle", 0, 0, 32, 96]]))
        f.write(line("sft", 0, [["red rectangle", 0, 0, 32, 64]]))  # the same run again: this one counts
        f.write(line("gen2", 0, [["red rectangle", 0, 0, 32, 96]]))
    found = be.arm_pairs(path)
    assert sorted(found) == [("row", "gen2"), ("row", "sft")]
    assert [p[1] for p in found[("row", "sft")][0]] == [[0, 0, 0, 0]]
    assert be.tall_rows(found[("row", "gen2")]) == {"all": 1}
    assert be.tall_rows(found[("row", "sft")]) == {"none": 1}
    assert be.tall_rows([be.pairs(TRUTH, [["red rectangle", 0, 0, 32, 96], ["red rectangle", 32, 0, 64, 64]])]) == {
        "some": 1
    }
    be.main([str(path)])
    out = capsys.readouterr().out
    assert "row_sft_iou75=1 " in out and "row_gen2_iou75=0 " in out and "row_gen2_tall_y2_signed=32" in out
    assert "row_gen2_tall_rows_off=1" in out and "row_sft_tall_rows_off=0" in out
    with pytest.raises(SystemExit, match="no such detections ledger"):
        be.main([str(tmp_path / "absent.jsonl.gz")])
