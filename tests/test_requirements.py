"""`rmsft train` checks the packages its spec needs before anything is paid for: the reference job
(training.deepspeed_stage: 2) used to fail only once the learner had loaded, on an image without
DeepSpeed. (Which image installs what: tests/operator/test_operator_image.py.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rmsft.jobspec import parse_job
from rmsft.requirements import MissingRequirementError, require_learner_runtime

ROOT = Path(__file__).resolve().parent.parent


def _doc(**training) -> dict:
    doc = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    doc["spec"]["training"].update(training)
    return doc


def test_this_environment_has_what_the_configs_need() -> None:
    require_learner_runtime(parse_job(_doc()))
    require_learner_runtime(parse_job(_doc(deepspeed_stage=2)))  # scripts/setup.sh installs DeepSpeed


def test_a_missing_package_is_named_with_the_spec_key(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(
        MissingRequirementError,
        match=r"peft \(spec.training.finetune: lora\) not installed: "
        r"install it with `pip install -c requirements/constraints.txt",
    ):
        require_learner_runtime(parse_job(_doc()))
    require_learner_runtime(parse_job(_doc(finetune="full")))  # full fine-tuning does not need peft


def test_rmsft_train_without_deepspeed_fails_at_start(tmp_path: Path) -> None:
    shim = tmp_path / "shim" / "deepspeed"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('DeepSpeed is not installed in this image')\n")
    job = tmp_path / "job.yaml"
    # No model and no data there: the check must come before anything would look at them.
    doc = _doc(deepspeed_stage=2)
    doc["spec"]["model"]["path"] = str(tmp_path / "no-model")
    doc["spec"]["training"]["data"]["path"] = str(tmp_path / "no-data.jsonl")
    job.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim.parent), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
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
    assert "deepspeed (spec.training.deepspeed_stage: 2) cannot be imported" in err
    assert "pip install --no-build-isolation -c requirements/constraints.txt deepspeed" in err
    assert "no-data.jsonl" not in err
    assert time.monotonic() - t0 < 60
