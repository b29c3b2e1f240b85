"""The CLI turns bad input into one clear line and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _rmsft(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rmsft_cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def _bad_jobs(tmp_path: Path) -> list[tuple[Path, str]]:
    good = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    unknown = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    unknown["spec"]["rollout"]["replicaz"] = 2
    negative = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    negative["spec"]["training"]["lr"] = -1
    cases = {
        "malformed.yaml": ("spec: [unclosed", "not valid YAML"),
        "unknown.yaml": (yaml.safe_dump(unknown), "spec.rollout.replicaz: unknown key"),
        "negative.yaml": (yaml.safe_dump(negative), "spec.training.lr"),
        "nokind.yaml": (yaml.safe_dump({k: v for k, v in good.items() if k != "kind"}), "no document with kind"),
    }
    out = []
    for name, (text, expected) in cases.items():
        (tmp_path / name).write_text(text)
        out.append((tmp_path / name, expected))
    out.append((tmp_path / "missing.yaml", "cannot read"))
    return out


@pytest.mark.parametrize("command", ["local", "train"])
def test_bad_job_files_give_one_clear_error(tmp_path: Path, command: str) -> None:
    for path, expected in _bad_jobs(tmp_path):
        args = [command, str(path)] if command == "local" else [command, "--config", str(path), "--servers", "x:1"]
        res = _rmsft(*args)
        assert res.returncode == 2, (path.name, res.stdout, res.stderr)
        err = " ".join(res.stderr.split())
        assert expected in err, (path.name, err)
        assert "Traceback" not in res.stderr


def test_train_with_missing_dataset_names_it(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    doc["spec"]["training"]["data"]["path"] = str(tmp_path / "absent.jsonl")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    res = _rmsft("train", "--config", str(tmp_path / "job.yaml"), "--servers", "127.0.0.1:1", "--metrics-port", "0")
    assert res.returncode == 2, res.stderr
    assert "absent.jsonl does not exist" in " ".join(res.stderr.split())
