"""Issue 41: whose a checkpoint folder is. Each checkpoint records its run's lineage; pruning deletes only the
saving run's own checkpoints; a resume refuses another lineage's; one learner writes a folder at a time."""

from __future__ import annotations

import copy
import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from learner.train.checkpoint_files import list_checkpoints, save_checkpoint
from learner.train.checkpoint_owner import (
    LINEAGE_FILE,
    CheckpointFolderBusyError,
    CheckpointLineageError,
    WriterLock,
    check_resumable,
    lineage_of,
)
from rmsft.jobspec import parse_job

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())


def _job(name: str = "tiny", **training):
    doc = copy.deepcopy(BASE)
    doc["metadata"]["name"] = name
    doc["spec"]["training"].update(training)
    return parse_job(doc)


def test_the_lineage_keeps_what_a_resume_may_change_and_names_what_it_may_not() -> None:
    mine = lineage_of(_job())
    assert lineage_of(_job(steps=500, lr=3e-4, warmup_steps=5))["digest"] == mine["digest"]
    for other in (
        _job(name="other"),
        _job(seed=7),
        _job(prompts_per_step=8),
        _job(finetune="full"),
        _job(data={"path": "elsewhere.jsonl"}),
    ):
        assert lineage_of(other)["digest"] != mine["digest"]


def test_pruning_deletes_only_the_saving_runs_own_checkpoints(tmp_path: Path) -> None:
    """Before: keep=2 kept the two highest steps in the folder, so beside another run's step-5 and step-6 every
    checkpoint this run wrote was deleted right after being written."""
    theirs, mine = lineage_of(_job(name="theirs")), lineage_of(_job())
    for step in (5, 6):
        save_checkpoint(tmp_path, step, {"step": step}, keep=2, lineage=theirs)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"step": step}, keep=2, lineage=mine)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-2", "step-3", "step-5", "step-6"]
    assert json.loads((tmp_path / "step-3" / LINEAGE_FILE).read_text())["digest"] == mine["digest"]


def test_a_resume_refuses_another_lineages_checkpoint_naming_what_differs(tmp_path: Path) -> None:
    mine = lineage_of(_job())
    ours = save_checkpoint(tmp_path / "a", 1, {"step": 1}, lineage=mine)
    assert check_resumable(ours, mine, resume_any=False) is None
    theirs = save_checkpoint(tmp_path / "b", 4, {"step": 4}, lineage=lineage_of(_job(name="other", seed=3)))
    with pytest.raises(CheckpointLineageError) as e:
        check_resumable(theirs, mine, resume_any=False)
    said = str(e.value)
    assert "job 'other' (this one: 'tiny')" in said and "spec.training.seed 3 (this job: 0)" in said
    assert "resume_any" in said and "spec.training.checkpoint.dir" in said
    assert "resumed anyway" in (check_resumable(theirs, mine, resume_any=True) or "")
    unrecorded = save_checkpoint(tmp_path / "c", 2, {"step": 2})  # written before checkpoints recorded lineage
    assert "records no lineage" in (check_resumable(unrecorded, mine, resume_any=False) or "")


_HOLDER = textwrap.dedent("""
    import sys, time
    from learner.train.checkpoint_owner import WriterLock
    WriterLock(sys.argv[1], run_id="r-holder", job="ns/holder", wait_s=0)
    print("held", flush=True)
    time.sleep(600)
""")


def _hold(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_one_writer_per_folder_until_the_holder_is_gone(tmp_path: Path) -> None:
    """A second learner on a held folder waits, then stops naming the holder; a killed holder frees it."""
    holder = _hold(tmp_path)
    try:
        waits: list[str] = []
        with pytest.raises(CheckpointFolderBusyError) as e:
            WriterLock(tmp_path, run_id="r-2", job="ns/second", wait_s=0.3, poll_s=0.1, on_wait=waits.append)
        assert f"pid {holder.pid}" in str(e.value) and "run r-holder" in str(e.value)
        assert len(waits) == 1 and "waiting up to 0 s" in waits[0]
    finally:
        holder.kill()
        holder.wait()
    lock = WriterLock(tmp_path, run_id="r-2", job="ns/second", wait_s=0)  # SIGKILL released it
    again = WriterLock(tmp_path, run_id="r-3", job="ns/second", wait_s=0)  # this process: shared, not released
    again.release()
    refused = subprocess.run(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], cwd=ROOT, timeout=60, capture_output=True, text=True
    )  # still held by `lock` after the second hold's release
    assert refused.returncode != 0 and "CheckpointFolderBusyError" in refused.stderr
    lock.release()
    _hold(tmp_path).kill()  # and free once the last hold is released


def test_rmsft_train_on_a_held_folder_exits_for_a_retry(tmp_path: Path, data_path: Path) -> None:
    """`rmsft train` stops before loading anything, in one line, with the retry exit code (not 2, which the learner
    Job's podFailurePolicy takes as a configuration no retry fixes)."""
    from rmsft_cli.app import BUSY_EXIT

    ckpt = tmp_path / "ckpt"
    doc = copy.deepcopy(BASE)
    doc["spec"]["training"].update(
        checkpoint={"dir": str(ckpt)}, data={"path": str(data_path)}, log_dir=str(tmp_path / "tb")
    )
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    ckpt.mkdir()
    holder = _hold(ckpt)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "rmsft_cli", "train", "--config", str(cfg), "--servers", "127.0.0.1:1"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**__import__("os").environ, "RMSFT_CHECKPOINT_WRITER_WAIT_S": "0"},
        )
    finally:
        holder.kill()
        holder.wait()
    assert run.returncode == BUSY_EXIT, run.stderr[-2000:]
    assert "is held by another learner" in run.stderr and f"pid {holder.pid}" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_checkpoint_recording_the_same_paths_relative_to_the_working_directory_is_this_lineage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 64: job files' relative paths are now read against their folder (absolute in the lineage); a
    checkpoint an earlier rmsft wrote recorded them as written, relative to the working directory it ran in."""
    monkeypatch.chdir(tmp_path)
    mine = lineage_of(_job(**{"data": {"path": str(tmp_path / "d.jsonl")}}))
    earlier = copy.deepcopy(mine)
    earlier["fields"]["training.data.path"] = "d.jsonl"  # what the earlier run, started in tmp_path, wrote
    earlier["digest"] = "0" * 16
    ckpt = save_checkpoint(tmp_path / "a", 1, {"step": 1}, lineage=earlier)
    assert check_resumable(ckpt, mine, resume_any=False) is None
    earlier["fields"]["training.data.path"] = "other/d.jsonl"  # another file: still refused
    other = save_checkpoint(tmp_path / "b", 1, {"step": 1}, lineage=earlier)
    with pytest.raises(CheckpointLineageError, match="spec.training.data.path 'other/d.jsonl'"):
        check_resumable(other, mine, resume_any=False)


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS])
def test_a_filesystem_without_posix_locks_is_named_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """Issue 60: ENOLCK/ENOSYS from fcntl.lockf (NFS mounted nolock, a FUSE mount) is no other learner holding the
    folder: the error says the filesystem has no POSIX locks and what to do, at once (no wait for a holder), and
    refuses the configuration (exit 2: the same volume comes back on a retry)."""
    from learner.train import checkpoint_owner
    from learner.train.checkpoint_owner import CheckpointFolderLockError, WriterLock
    from rmsft.exit_codes import CONFIG_EXIT, exit_code_for

    def no_locks(fd: int, cmd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(checkpoint_owner.fcntl, "lockf", no_locks)
    t0 = time.monotonic()
    with pytest.raises(CheckpointFolderLockError, match="filesystem with no POSIX locks") as caught:
        WriterLock(tmp_path, run_id="r-1", job="ns/job", wait_s=30)
    assert time.monotonic() - t0 < 5
    assert "held by another learner" not in str(caught.value) and "nolock" in str(caught.value)
    assert exit_code_for(caught.value) == CONFIG_EXIT
