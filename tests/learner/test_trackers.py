"""spec.training.report_to: TensorBoard, MLflow (its file store) and Weights & Biases (offline) each get the
same scalars and the job's config, read back from what each wrote to disk (TensorBoard's reader, MLflow's own
client on the file store, the offline `run-<id>.wandb` file); a tracker that is not installed is refused at
start naming the `tracking` extra. No network: W&B runs offline, MLflow on a `file:` store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from learner.tracking.tracker import TrackingError, read_events, read_wandb_offline, require_trackers, tracker_of
from rmsft.jobspec import JobSpecError, parse_job
from rmsft.requirements import MissingRequirementError, require_learner_runtime

ROOT = Path(__file__).resolve().parents[2]
STEPS = {1: {"train/loss": 1.5, "train/reward": 0.25}, 2: {"train/loss": 1.25, "train/reward": 0.5}}


def _doc(tmp_path: Path, **training) -> dict:
    doc = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    doc["spec"]["training"]["checkpoint"]["dir"] = str(tmp_path / "ck")
    doc["spec"]["training"].update(training)
    return doc


@pytest.fixture
def tracker_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B's own settings and caches in tmp_path, no git probe, no console capture: nothing outside the test; MLflow's
    file-store switch unset."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    # Unset, as on a fresh learner: the tracker sets it for its file: store (setenv first so teardown unsets it).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")


@pytest.mark.usefixtures("tracker_env")
def test_every_tracker_gets_the_same_scalars_and_the_config(tmp_path: Path) -> None:
    job = parse_job(_doc(tmp_path, report_to=["tensorboard", "mlflow", "wandb"]))
    manifest = json.loads(json.dumps(job.to_manifest()))
    with tracker_of(job) as tracker:
        for step, values in STEPS.items():
            tracker.scalars(step, values)
        tracker.image(2, "eval/pictures", Image.new("RGB", (16, 8), (200, 30, 30)))
    want = {tag: [(s, v[tag]) for s, v in STEPS.items()] for tag in STEPS[1]}

    tb, tb_images = read_events(tmp_path / "ck" / "tensorboard")
    assert tb == want and [s for s, _ in tb_images["eval/pictures"]] == [2]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'ck' / 'mlruns'}")
    experiment = client.get_experiment_by_name(job.metadata.name)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == job.metadata.name and run.info.status == "FINISHED"
    assert {tag: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag)] for tag in want} == want
    assert run.data.params["spec.training.lr"] == str(job.spec.training.lr)
    assert run.data.params["spec.training.report_to"] == '["tensorboard", "mlflow", "wandb"]'
    pictures = [a.path for a in client.list_artifacts(run.info.run_id, "images") if a.path.endswith(".png")]
    assert len(pictures) == 1 and "eval~pictures+step+2+" in pictures[0]
    local = client.download_artifacts(run.info.run_id, "job.yaml", str(tmp_path / "dl"))
    assert yaml.safe_load(Path(local).read_text()) == manifest

    (run_file,) = (tmp_path / "ck" / "wandb").glob("offline-run-*/run-*.wandb")
    scalars, config = read_wandb_offline(run_file)
    assert scalars == want
    assert len(list((run_file.parent / "files" / "media").rglob("*.png"))) == 1  # the picture
    assert config == manifest


def test_report_to_default_empty_and_twice(tmp_path: Path) -> None:
    t = parse_job(_doc(tmp_path)).spec.training
    assert t.report_to == ["tensorboard"]
    with tracker_of(parse_job(_doc(tmp_path, report_to=[]))) as tracker:
        assert not tracker.enabled and tracker.log_dir is None
    assert not (tmp_path / "ck").exists()  # nothing written with no tracker
    with pytest.raises(JobSpecError, match="report_to names a tracker more than once: mlflow"):
        parse_job(_doc(tmp_path, report_to=["mlflow", "tensorboard", "mlflow"]))
    with pytest.raises(JobSpecError, match="report_to"):
        parse_job(_doc(tmp_path, report_to=["swanlab"]))


def test_a_tracker_not_installed_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it raises ImportError
    with pytest.raises(
        TrackingError,
        match=r"report_to names a tracker this environment lacks: wandb \(wandb not "
        r"installed\); install it with `pip install 'rmsft\[tracking\]'`",
    ):
        require_trackers(["tensorboard", "mlflow", "wandb"])
    require_trackers(["tensorboard", "mlflow"])
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(
        MissingRequirementError,
        match=r"mlflow-skinny \(spec.training.report_to: mlflow\) cannot be "
        r"imported .*install it with .*'rmsft\[tracking\]'",
    ):
        require_learner_runtime(parse_job(_doc(tmp_path, report_to=["mlflow"])))


def test_rmsft_train_without_the_tracker_fails_at_start(tmp_path: Path) -> None:
    shim = tmp_path / "shim" / "mlflow"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('mlflow is not installed in this image')\n")
    doc = _doc(tmp_path, report_to=["tensorboard", "mlflow"])
    doc["spec"]["model"]["path"] = str(tmp_path / "no-model")  # the check comes before anything looks at them
    doc["spec"]["training"]["data"]["path"] = str(tmp_path / "no-data.jsonl")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim.parent), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "train", "--config", str(job), "--servers", "h:1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=env,
    )
    err = " ".join(res.stderr.split())
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "mlflow-skinny (spec.training.report_to: mlflow) cannot be imported (ImportError: mlflow is not" in err
    assert "pip install -c requirements/constraints.txt 'rmsft[tracking]'" in err, err


def test_rmsft_local_without_the_tracker_fails_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from rmsft_cli.app import app

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    doc = _doc(tmp_path, report_to=["wandb"])
    doc["spec"]["model"]["path"] = str(tmp_path / "no-model")  # refused before anything would look at them
    doc["spec"]["training"]["data"]["path"] = str(tmp_path / "no-data.jsonl")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    res = CliRunner().invoke(app, ["local", str(job), "--work-dir", str(tmp_path / "work")])
    said = " ".join((res.stdout + res.stderr).split())
    assert res.exit_code == 2 and "Traceback" not in said, said
    assert (
        "report_to names a tracker this environment lacks: wandb (wandb not installed); install it with "
        "`pip install 'rmsft[tracking]'`" in said
    ), said
    assert not (tmp_path / "ck").exists()  # no checkpoint folder, no servers: nothing started


@pytest.mark.usefixtures("tracker_env")
def test_a_tracker_that_fails_to_log_is_warned_about_once_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow.tracking import MlflowClient

    job = parse_job(_doc(tmp_path, report_to=["tensorboard", "mlflow"]))
    with tracker_of(job) as tracker:

        def down(*a: object, **k: object) -> None:
            raise ConnectionError("tracking server down")

        monkeypatch.setattr(MlflowClient, "log_batch", down)
        for step, values in STEPS.items():
            tracker.scalars(step, values)  # no raise: the run goes on
    assert caplog.text.count("MLflow could not log scalars (tracking server down)") == 1
    tb, _ = read_events(tmp_path / "ck" / "tensorboard")
    assert tb["train/loss"] == [(1, 1.5), (2, 1.25)]  # the other trackers still got them


def test_the_dry_run_says_where_each_tracker_goes(tmp_path: Path) -> None:
    from learner.local import dry_run

    job = parse_job(_doc(tmp_path, report_to=["tensorboard", "mlflow", "wandb"], wandb={"dir": str(tmp_path / "w")}))
    said = " ".join(dry_run(job, work_dir=tmp_path / "work"))
    ck = tmp_path / "ck"
    assert (
        f"tracking: TensorBoard in {ck}/tensorboard (tensorboard --logdir {ck}/tensorboard); "
        f"MLflow at file:{ck}/mlruns; W&B (offline) in {tmp_path / 'w'}/wandb"
    ) in said, said
