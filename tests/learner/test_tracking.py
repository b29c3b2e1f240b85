"""TensorBoard event files written by `learner.tracking.tracker.Tracker` and read back with TensorBoard's reader;
optional Weights & Biases (a stand-in module: the real one is not installed and never needed)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from learner.evaluation.draw import draw_detections
from learner.tracking.tracker import Tracker, TrackingError, decode_png, read_events


def _picture() -> Image.Image:
    img = Image.new("RGB", (96, 64), (40, 40, 40))
    return draw_detections(
        img,
        [("red circle", "bbox_2d", [10, 10, 40, 40])],
        [("red circle", "bbox_2d", [12, 11, 41, 38])],
        title="held-out r1, step 3",
    )


def test_scalars_and_an_image_read_back(tmp_path: Path) -> None:
    pic = _picture()
    with Tracker(tmp_path / "tb", run_name="demo", config={"spec": {"training": {"steps": 3}}}) as tr:
        assert tr.log_dir == tmp_path / "tb" and tr.enabled
        for step in (1, 2, 3):
            tr.scalars(step, {"train/loss": 1.0 / step, "train/f1": 0.1 * step})
        tr.scalars(3, {"eval/map": 0.25})
        tr.image(3, "eval/r1", pic)
        tr.flush()
    scalars, images = read_events(tmp_path / "tb")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([1.0, 0.5, 1 / 3])
    assert scalars["train/f1"][-1] == (3, pytest.approx(0.3))
    assert scalars["eval/map"] == [(3, 0.25)]
    ((step, png),) = images["eval/r1"]
    back = decode_png(png)
    assert step == 3 and back.size == pic.size and back.format == "PNG"
    assert back.convert("RGB").getpixel((200, 200)) == pic.getpixel((200, 200))


def test_a_resumed_run_appends_to_the_same_folder(tmp_path: Path) -> None:
    with Tracker(tmp_path) as tr:  # crashed after step 3; its last checkpoint was step 1
        for step in (1, 2, 3):
            tr.scalars(step, {"train/loss": float(step)})
    with Tracker(tmp_path, resume_step=2) as tr:  # a second process writes a second event file
        for step in (2, 3, 4):
            tr.scalars(step, {"train/loss": 10.0 * step})
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    # Steps 2 and 3 of the crashed run are hidden, not shown twice.
    assert read_events(tmp_path)[0]["train/loss"] == [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]


def test_none_is_a_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_PROJECT", "p")  # not even W&B starts from the environment alone
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it would raise
    tr = Tracker(None, config={"a": 1})
    assert tr.log_dir is None and not tr.enabled
    tr.scalars(1, {"x": 1.0})
    tr.image(1, "pic", _picture())
    tr.flush()
    tr.close()


def test_an_unwritable_folder_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(TrackingError, match=r"TensorBoard folder .*file/tb is not writable.*spec.training.log_dir"):
        Tracker(blocker / "tb")


def test_read_events_of_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no TensorBoard folder"):
        read_events(tmp_path / "nope")


class _FakeRun:
    def __init__(self, **kwargs: Any) -> None:
        self.init = kwargs
        self.logged: list[tuple[dict[str, Any], int]] = []
        self.finished = False

    def log(self, data: dict[str, Any], step: int) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished = True


def _fake_wandb(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> list[_FakeRun]:
    runs: list[_FakeRun] = []

    def init(**kwargs: Any) -> _FakeRun:
        if fail:
            raise RuntimeError("not logged in")
        runs.append(_FakeRun(**kwargs))
        return runs[-1]

    mod = types.ModuleType("wandb")
    mod.init = init  # type: ignore[attr-defined]
    mod.Image = lambda img: ("image", img.size)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return runs


def test_wandb_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _fake_wandb(monkeypatch)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    Tracker(tmp_path / "a").close()
    Tracker(tmp_path / "b", wandb=False).close()
    assert runs == []

    monkeypatch.setenv("WANDB_PROJECT", "det")
    with Tracker(tmp_path / "c", run_name="demo", config={"k": 1}) as tr:
        tr.scalars(5, {"train/loss": 0.5})
        tr.image(5, "eval/r1", _picture())
    (run,) = runs
    assert run.init == {"project": "det", "name": "demo", "config": {"k": 1}, "dir": str(tmp_path / "c")}
    assert run.logged[0] == ({"train/loss": 0.5}, 5)
    assert run.logged[1][0]["eval/r1"][0] == "image" and run.logged[1][1] == 5
    assert run.finished
    assert read_events(tmp_path / "c")[0]["train/loss"] == [(5, 0.5)]  # TensorBoard too


def test_wandb_missing_or_failing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    monkeypatch.setenv("WANDB_PROJECT", "det")
    with caplog.at_level("WARNING", logger="rmsft.learner"):
        Tracker(tmp_path / "a").close()  # from the environment: a warning, TensorBoard goes on
    assert "wandb package is not installed" in caplog.text
    with pytest.raises(TrackingError, match="asked for but cannot be imported"):
        Tracker(tmp_path / "b", wandb=True)

    _fake_wandb(monkeypatch, fail=True)
    caplog.clear()
    with caplog.at_level("WARNING", logger="rmsft.learner"):
        tr = Tracker(tmp_path / "c")
    assert "could not start a run (not logged in)" in caplog.text and tr.enabled
    tr.close()
    with pytest.raises(TrackingError, match="could not start a run: not logged in"):
        Tracker(tmp_path / "d", wandb=True)
