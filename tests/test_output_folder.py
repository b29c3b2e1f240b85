"""rmsft/output_folder.py: an output folder (an export, a prepared model) is replaced whole, and what a killed
writer left beside it (gigabytes, for an export) is removed or put back by the next write."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from rmsft import output_folder
from rmsft.output_folder import OutputFolderError, staged_folder, sweep_leftovers


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _folder(path: Path, text: str) -> Path:
    path.mkdir(parents=True)
    (path / "weights").write_text(text)
    return path


def _siblings(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir())


@pytest.mark.parametrize("can_exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_folder_is_replaced_whole_and_nothing_is_left_beside_it(
    tmp_path: Path, can_exchange: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = _folder(tmp_path / "export", "old")
    if can_exchange:
        probe_a, probe_b = _folder(tmp_path / "a", "a"), _folder(tmp_path / "b", "b")
        assert output_folder.exchange(probe_a, probe_b)  # this filesystem can: the atomic path is the one taken
        assert (probe_a / "weights").read_text() == "b"
        for p in (probe_a, probe_b):
            (p / "weights").unlink()
            p.rmdir()
    else:
        monkeypatch.setattr(output_folder, "exchange", lambda a, b: False)
    with staged_folder(dst, overwrite=True) as tmp:
        assert (dst / "weights").read_text() == "old"  # the old folder stays whole while the new one is written
        (tmp / "weights").write_text("new")
    assert (dst / "weights").read_text() == "new"
    assert _siblings(dst) == ["export"]


def test_a_failed_write_leaves_the_old_folder_and_no_temporary_one(tmp_path: Path) -> None:
    dst = _folder(tmp_path / "export", "old")
    with pytest.raises(RuntimeError, match="disk full"), staged_folder(dst, overwrite=True) as tmp:
        (tmp / "weights").write_text("half")
        raise RuntimeError("disk full")
    assert (dst / "weights").read_text() == "old" and _siblings(dst) == ["export"]


def test_a_killed_writers_temporary_folder_is_removed_by_the_next_write_a_live_ones_kept(tmp_path: Path) -> None:
    dst = tmp_path / "export"
    dead = _folder(tmp_path / f".export.tmp-{_dead_pid()}-0123abcd", "half")
    live_pid = os.getppid()  # pytest's parent: alive, and not this process
    live = _folder(tmp_path / f".export.tmp-{live_pid}-89abcdef", "in progress")
    other = _folder(tmp_path / ".other.tmp-1-00", "another folder's")  # not a leftover of this folder
    with staged_folder(dst, overwrite=False) as tmp:
        (tmp / "weights").write_text("new")
    assert not dead.exists()
    assert live.exists() and other.exists()
    assert (dst / "weights").read_text() == "new"


def test_a_replace_killed_between_its_two_renames_gets_the_previous_folder_back(tmp_path: Path) -> None:
    """Killed after renaming the old folder aside and before the new one went in (the filesystem could not
    exchange): no `export`, the old one complete under its aside name, the new one under its temporary name."""
    pid = _dead_pid()
    dst = tmp_path / "export"
    aside = _folder(tmp_path / f".export.old-{pid}-0123abcd", "previous")
    unfinished = _folder(tmp_path / f".export.tmp-{pid}-0123abcd", "new")
    assert sorted(p.name for p in sweep_leftovers(dst)) == [aside.name, unfinished.name]
    assert (dst / "weights").read_text() == "previous"
    assert _siblings(dst) == ["export"]
    # With `export` in place, an aside copy of an older replace is only a leftover: removed, `export` untouched.
    stale = _folder(tmp_path / f".export.old-{pid}-feedbeef", "older")
    assert sweep_leftovers(dst) == [stale]
    assert (dst / "weights").read_text() == "previous" and _siblings(dst) == ["export"]


def test_leftovers_named_with_this_process_id_are_a_previous_incarnations(tmp_path: Path) -> None:
    """A restarted container often runs its learner under the same pid as the one that was killed."""
    left = _folder(tmp_path / f".export.tmp-{os.getpid()}-0123abcd", "half")
    assert sweep_leftovers(tmp_path / "export") == [left]
    assert not left.exists()


def test_a_folder_with_files_is_refused_without_overwrite_and_nothing_is_written(tmp_path: Path) -> None:
    dst = _folder(tmp_path / "export", "old")
    with (
        pytest.raises(OutputFolderError, match="exists and is not empty.*--overwrite"),
        staged_folder(dst, overwrite=False),
    ):
        pytest.fail("the block must not run")
    assert _siblings(dst) == ["export"]
