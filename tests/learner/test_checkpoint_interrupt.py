"""A checkpoint save stopped at any moment leaves no half checkpoint that a resume would take, and the pause points
(rmsft.pause_points) the fault matrix uses stop a process exactly where they say.

A child process saves the checkpoint of step 2, then of step 4 (or of step 2 again) with the `checkpoint` pause
point armed: it blocks with the new checkpoint written into its temporary folder, not renamed into place; the test
then sends SIGINT (the exception unwinds the save) or SIGKILL (nothing runs). The newest complete checkpoint is
still the old one, whole; the next save removes what a killed one left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from learner.train.checkpoint_files import list_checkpoints, load_latest, save_checkpoint
from rmsft import pause_points
from rmsft.pause_points import MARKER_ENV, PAUSE_AT_ENV, PausePointError

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import os, signal, sys, torch
from learner.train.checkpoint_files import save_checkpoint
# Ctrl-C raises, as in a terminal: a test run started in the background inherits SIGINT ignored (POSIX shells do that
# to background jobs), and so would this process.
signal.signal(signal.SIGINT, signal.default_int_handler)
root, again = sys.argv[1], int(sys.argv[2])
armed = os.environ.pop("RMSFT_TEST_PAUSE_AT")  # the first save is not stopped
save_checkpoint(root, 2, {"step": 2, "w": torch.full((64,), 2.0)})
os.environ["RMSFT_TEST_PAUSE_AT"] = armed
save_checkpoint(root, again, {"step": again, "w": torch.full((64,), float(again))})  # paused here
print("not paused", flush=True)
"""


def _paused_child(tmp_path: Path, step: int) -> tuple[subprocess.Popen, Path]:
    marker = tmp_path / "paused"
    env = {**os.environ, "PYTHONPATH": str(ROOT), PAUSE_AT_ENV: f"checkpoint:{step}", MARKER_ENV: str(marker)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "ckpt"), str(step)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the child never reached the pause point: {proc.communicate()[0][-2000:]}")
        time.sleep(0.05)
    assert marker.read_text().split() == [str(proc.pid), f"checkpoint:{step}"]
    return proc, tmp_path / "ckpt"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
@pytest.mark.parametrize("step", [4, 2], ids=["new-step", "same-step-again"])
def test_checkpoint_stopped_mid_save_leaves_the_last_complete_one(
    tmp_path: Path, sig: signal.Signals, step: int
) -> None:
    proc, ckpt = _paused_child(tmp_path, step)
    try:
        # Stopped mid-save: the new checkpoint is in its temporary folder, the old one complete.
        assert sorted(p.name for p in ckpt.glob(".tmp-step-*")) == [f".tmp-step-{step}"]
        assert [p.name for p in list_checkpoints(ckpt)] == ["step-2"]
        proc.send_signal(sig)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode != 0 and "not paused" not in out, out
    if sig == signal.SIGINT:  # unwound: its temporary folder went with it
        assert "KeyboardInterrupt" in out
        assert sorted(p.name for p in ckpt.iterdir()) == ["step-2"]
    else:  # killed: the temporary folder is left, and is no checkpoint
        assert sorted(p.name for p in ckpt.iterdir()) == [f".tmp-step-{step}", "step-2"]
    assert [p.name for p in list_checkpoints(ckpt)] == ["step-2"]
    loaded = load_latest(ckpt)
    assert loaded["step"] == 2 and loaded["w"].tolist() == [2.0] * 64
    # The next save removes what the stopped one left, and replaces a checkpoint of the same step whole.
    import torch

    save_checkpoint(ckpt, 2, {"step": 2, "w": torch.full((64,), 3.0)})
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2"]
    assert load_latest(ckpt)["w"].tolist() == [3.0] * 64


def test_a_step_folder_without_its_state_is_no_checkpoint(tmp_path: Path) -> None:
    import torch

    save_checkpoint(tmp_path, 2, {"step": 2})
    (tmp_path / "step-4").mkdir()  # e.g. a copy cut short
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-2"]
    assert load_latest(tmp_path) == {"step": 2}
    save_checkpoint(tmp_path, 4, {"step": 4, "w": torch.zeros(2)})
    assert load_latest(tmp_path)["step"] == 4


def test_saving_a_step_again_swaps_it_in_whole(tmp_path: Path) -> None:
    """A run resumed at its final step saves that step again: one atomic exchange, the new copy in, nothing aside."""
    from learner.train import checkpoint_files

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir(), (a / "in-a").touch()
    assert checkpoint_files._exchange(a, b)  # this filesystem can exchange: the path below is the one taken
    assert [p.name for p in b.iterdir()] == ["in-a"] and list(a.iterdir()) == []
    a.rmdir(), (b / "in-a").unlink(), b.rmdir()
    save_checkpoint(tmp_path, 4, {"step": 4, "copy": "first"})
    save_checkpoint(tmp_path, 4, {"step": 4, "copy": "second"})
    assert load_latest(tmp_path)["copy"] == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]


def test_a_re_save_killed_between_its_renames_loses_neither_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the filesystem cannot exchange, the old copy is renamed aside first; stopped right after that rename
    (the new one not yet in place), the old copy is still the checkpoint of its step, and the next save puts it back
    instead of deleting it as a leftover (issue 41)."""
    from learner.train import checkpoint_files

    monkeypatch.setattr(checkpoint_files, "_exchange", lambda a, b: False)
    save_checkpoint(tmp_path, 2, {"step": 2})
    save_checkpoint(tmp_path, 4, {"step": 4, "copy": "first"})
    real_rename = Path.rename

    def rename(self: Path, target: Path) -> Path:
        if self.name == ".tmp-step-4":  # the second rename: the process dies here
            raise KeyboardInterrupt
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 4, {"step": 4, "copy": "second"})
    monkeypatch.setattr(Path, "rename", real_rename)
    assert not (tmp_path / "step-4").exists() and (tmp_path / ".old-step-4" / "state.pt").is_file()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-2", ".old-step-4"]
    assert load_latest(tmp_path) == {"step": 4, "copy": "first"}  # what a resume takes
    save_checkpoint(tmp_path, 6, {"step": 6}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-6"]
    assert [torch_load(tmp_path / n)["step"] for n in ("step-4", "step-6")] == [4, 6]


def torch_load(folder: Path) -> dict:
    import torch

    return torch.load(folder / "state.pt", weights_only=False)


@pytest.mark.parametrize("value", ["syncs", "sync:x", "checkpoint:-1", ":3"])
def test_a_wrong_pause_point_names_the_variable_and_the_points(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(PAUSE_AT_ENV, value)
    with pytest.raises(PausePointError, match=rf"{PAUSE_AT_ENV}=.*generate, sync, checkpoint"):
        pause_points.pause_at("sync", 3)


def test_unarmed_or_other_points_and_numbers_pass(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(MARKER_ENV, str(tmp_path / "paused"))
    for value in ("", "generate:3", "sync:4"):  # another point, another number: no pause
        monkeypatch.setenv(PAUSE_AT_ENV, value)
        pause_points.pause_at("sync", 3)
    assert not (tmp_path / "paused").exists()


def test_an_armed_point_needs_a_marker_and_the_main_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(PAUSE_AT_ENV, "sync")
    monkeypatch.delenv(MARKER_ENV, raising=False)
    with pytest.raises(PausePointError, match=MARKER_ENV):
        pause_points.pause_at("sync", 1)
    monkeypatch.setenv(MARKER_ENV, str(tmp_path / "paused"))
    errors: list[BaseException] = []

    def reach() -> None:
        try:
            pause_points.pause_at("sync", 1)
        except PausePointError as e:
            errors.append(e)

    t = threading.Thread(target=reach)
    t.start()
    t.join(10)
    assert not t.is_alive() and len(errors) == 1 and "main thread" in str(errors[0])
    assert not (tmp_path / "paused").exists()


def test_earlier_runs_keeps_the_newest_few(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 60: every fresh start moves the folder's checkpoints into earlier-runs/; it keeps the newest
    EARLIER_RUNS_KEPT of those sets, whatever else a user put there, so a job restarted fresh all week does not fill
    its claim."""
    from learner.train import checkpoint_files
    from learner.train.checkpoint_files import EARLIER_RUNS, EARLIER_RUNS_KEPT, set_aside_earlier

    (tmp_path / EARLIER_RUNS / "my-notes").mkdir(parents=True)
    made = []
    for run in range(EARLIER_RUNS_KEPT + 2):
        (tmp_path / "step-1").mkdir()
        (tmp_path / "step-1" / "state.pt").write_bytes(b"x")
        # one set-aside per "day": the folder names carry the time
        monkeypatch.setattr(
            checkpoint_files.time,
            "gmtime",
            lambda *_a, r=run: time.struct_time((2026, 12, 1 + r, 12, 0, 0, 0, 335 + r, 0)),
        )
        dest, steps = set_aside_earlier(tmp_path, f"run{run}")
        made.append(dest.name)
        assert steps == [1]
    kept = sorted(p.name for p in (tmp_path / EARLIER_RUNS).iterdir())
    assert kept == sorted([*made[-EARLIER_RUNS_KEPT:], "my-notes"])


def test_a_one_file_checkpoint_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """A checkpoint of the one-file layout (every rank's state in state.pt, before issue 60) is refused before any
    rank looks for its part, with what to do (finish with the release that wrote it, or export and start fresh), as a
    refused configuration (exit 2)."""
    from types import SimpleNamespace

    import torch

    from learner.train.checkpointer import Checkpointer, TrainState
    from learner.train.ranks import Ranks
    from rmsft.exit_codes import CONFIG_EXIT, exit_code_for

    save_checkpoint(
        tmp_path, 3, {"step": 3, "version": 3, "model": {}, "rank_states": [{}], "world_size": 1, "deepspeed_stage": 0}
    )
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir=str(tmp_path), resume_any=False), deepspeed_stage=0)
    ckpt = Checkpointer(cfg, Ranks.single(), torch.nn.Linear(2, 2), None, None, TrainState())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"one-file layout of earlier rmsft releases.*rmsft export") as refused:
        ckpt.resume()
    assert exit_code_for(refused.value) == CONFIG_EXIT  # refused: the same claim fails the same way, no retry
