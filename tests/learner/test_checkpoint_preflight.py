"""The learner checks at start that it can write training.checkpoint.dir: a job must never train
for hours and then fail at its final save because the folder is not writable."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from learner_fakes import FakeEngine, FakeServer

from learner.train.checkpoint_files import CheckpointDirError, check_checkpoint_dir

ROOT = Path(__file__).resolve().parents[2]


def test_creates_the_folder_and_leaves_nothing_behind(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "checkpoints"
    check_checkpoint_dir(target)
    assert target.is_dir() and list(target.iterdir()) == []


def test_an_uncreatable_folder_names_path_spec_key_and_the_claim(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    target = tmp_path / "file" / "checkpoints"  # fails even as root, unlike a chmod
    with pytest.raises(CheckpointDirError) as info:
        check_checkpoint_dir(target)
    msg = str(info.value)
    assert str(target) in msg and "spec.training.checkpoint.dir" in msg and "spec.learner.checkpointClaim" in msg


def test_a_folder_that_refuses_writes_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(fd: int) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "fsync", read_only)  # e.g. a read-only mount
    with pytest.raises(CheckpointDirError, match="Read-only file system"):
        check_checkpoint_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the probe is removed on failure too


def _job_doc(model_dir: Path, data: Path, ckpt: Path) -> dict:
    doc = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    doc["metadata"].pop("annotations")
    doc["spec"]["model"]["path"] = str(model_dir)
    doc["spec"]["training"]["data"]["path"] = str(data)
    doc["spec"]["training"]["checkpoint"] = {"dir": str(ckpt), "every": 0, "keep": 1}
    return doc


@pytest.fixture
def data_path(tmp_path: Path) -> Path:
    from rmsft_dev.synthetic import write_synthetic_dataset

    return write_synthetic_dataset(tmp_path / "train.jsonl", n=4, seed=0)


def test_trainer_fails_at_start_before_any_server_or_model_work(
    tiny_model_dir, data_path, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import learner.train.build as build_mod
    from rmsft.jobspec import parse_job

    (tmp_path / "file").write_text("")
    job = parse_job(_job_doc(tiny_model_dir, data_path, tmp_path / "file" / "ckpt"))

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded before the checkpoint folder was checked")

    monkeypatch.setattr(build_mod, "load_policy", no_model)  # build_loop loads the model
    server = FakeServer(FakeEngine())
    try:
        with pytest.raises(CheckpointDirError, match="spec.training.checkpoint.dir"):
            build_mod.build_loop(job, [server.address])
        assert server.engine.events == []  # no status, no sync, no rollout
    finally:
        server.stop()


def test_a_start_that_fails_after_the_claim_lets_go_of_what_it_made(
    tiny_model_dir, data_path, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """build_loop fails at the model's load, after rank 0 claimed the checkpoint folder: the claim is let go (a
    second writer takes the folder at once, no wait), and the same process then starts the same job."""
    import learner.train.build as build_mod
    from learner.train.checkpoint_owner import WRITER_LOCK, WriterLock
    from rmsft.jobspec import parse_job

    doc = _job_doc(tiny_model_dir, data_path, tmp_path / "ckpt")
    doc["spec"]["training"]["warm_start_steps"] = doc["spec"]["training"]["steps"]  # samples nothing: no server
    job = parse_job(doc)
    claimed: list[WriterLock] = []
    claim = build_mod.claim_checkpoint_dir
    monkeypatch.setattr(build_mod, "claim_checkpoint_dir", lambda *a: claimed.append(claim(*a)) or claimed[-1])

    def broken_model(*a, **kw):
        raise OSError(5, "Input/output error")  # e.g. EIO on the model's claim

    real_load = build_mod.load_policy
    monkeypatch.setattr(build_mod, "load_policy", broken_model)
    with pytest.raises(OSError, match="Input/output error"):
        build_mod.build_loop(job, [])
    assert len(claimed) == 1
    # Let go: the holder's record is gone with the hold (an open lock would name this run, and another learner
    # process would wait for it to end).
    assert (tmp_path / "ckpt" / WRITER_LOCK).read_text() == ""
    monkeypatch.setattr(build_mod, "load_policy", real_load)
    loop = build_mod.build_loop(job, [])
    try:
        assert loop.state.run_id != "" and len(claimed) == 2
    finally:
        loop.close()


def test_rmsft_train_exits_2_naming_the_folder(tiny_model_dir, data_path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "ckpt"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_job_doc(tiny_model_dir, data_path, target)))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rmsft_cli",
            "train",
            "--config",
            str(job),
            "--servers",
            "127.0.0.1:1",
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
    )
    err = " ".join(res.stderr.split())
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"the checkpoint folder {target} (spec.training.checkpoint.dir) is not writable" in err
