"""run.json: what a run was (job, seeds, versions, model and data digests), written atomically, kept
across resumed runs, and turned back into the job."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from learner.tracking.run_record import (
    RUN_FILE,
    data_digest,
    job_from_run_record,
    model_digest,
    read_run_record,
    run_record,
    write_run_record,
)
from rmsft.jobspec import JobSpecError, parse_job

ROOT = Path(__file__).resolve().parents[2]


def _job(**training):
    doc = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    doc["spec"]["training"].update(training)
    return parse_job(doc)


def _model(root: Path, fill: float = 0.0, rows: int = 4) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (root / "tokenizer.json").write_text(json.dumps({"vocab": ["a", "b"]}))
    save_file(
        {"w": np.full((rows, 8), fill, dtype=np.float32)}, str(root / "model.safetensors"), metadata={"format": "pt"}
    )
    (root / "training_args.bin").write_bytes(bytes([int(fill) % 256]) * 16)
    (root / ".cache").mkdir(exist_ok=True)
    (root / ".cache" / "download.lock").write_text(str(fill))  # the hub cache's own files: not the model
    return root


def _data(root: Path) -> Path:
    (root / "imgs").mkdir(parents=True, exist_ok=True)
    (root / "imgs" / "a.png").write_bytes(b"A" * 100)
    (root / "imgs" / "b.png").write_bytes(b"B" * 50)
    lines = [
        {"id": "1", "images": ["imgs/a.png"]},
        {"id": "2", "images": ["imgs/a.png", "imgs/b.png"]},
        {"id": "3", "images": ["data:image/png;base64,AAAA"]},
        {"id": "4"},
    ]
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_model_digest_reads_headers_not_weights(tmp_path: Path) -> None:
    base = model_digest(_model(tmp_path / "m"))
    assert base["files"]["model.safetensors"]["how"] == "safetensors-header"
    assert base["files"]["config.json"]["how"] == "file"
    assert base["files"]["training_args.bin"] == {"bytes": 16, "how": "size"}
    assert ".cache/download.lock" not in base["files"]
    assert "header" in base["covers"] and "size" in base["covers"]
    # Retrained weights of the same shapes: same digest (their bytes are not read).
    assert model_digest(_model(tmp_path / "m", fill=1.0))["sha256"] == base["sha256"]
    # Another shape, or another config: another digest.
    assert model_digest(_model(tmp_path / "m2", rows=5))["sha256"] != base["sha256"]
    (tmp_path / "m" / "config.json").write_text(json.dumps({"hidden_size": 16}))
    assert model_digest(tmp_path / "m")["sha256"] != base["sha256"]
    # Not a local folder (a hub id): recorded, nothing hashed.
    assert model_digest("Qwen/Qwen3-VL-2B-Instruct")["sha256"] is None


def test_model_digest_refuses_a_broken_safetensors(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8)
    with pytest.raises(ValueError, match="not a safetensors file"):
        model_digest(tmp_path)


def test_data_digest_covers_jsonl_and_image_bytes(tmp_path: Path) -> None:
    path = _data(tmp_path / "d")
    d = data_digest(path, None)
    assert (d["images"], d["image_bytes"], d["missing_images"]) == (2, 150, 0)  # a.png counted once
    assert d["covers"].endswith("image file's bytes")
    (tmp_path / "d" / "imgs" / "b.png").write_bytes(b"C" * 50)  # same size, other bytes
    assert data_digest(path, None)["sha256"] != d["sha256"]
    assert data_digest(path, None)["jsonl_sha256"] == d["jsonl_sha256"]
    # The same data under another folder (another mount) hashes the same: image paths are relative.
    moved = _data(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "imgs" / "b.png").write_bytes(b"C" * 50)
    assert data_digest(moved, None)["sha256"] == data_digest(path, None)["sha256"]


def test_data_digest_over_budget_hashes_sizes(tmp_path: Path) -> None:
    path = _data(tmp_path)
    d = data_digest(path, tmp_path, image_hash_budget=10)
    assert "path and size" in d["covers"] and "10-byte hashing budget" in d["covers"]
    (tmp_path / "imgs" / "b.png").write_bytes(b"C" * 50)  # same size: not seen, as documented
    assert data_digest(path, tmp_path, image_hash_budget=10)["sha256"] == d["sha256"]
    (tmp_path / "imgs" / "b.png").write_bytes(b"C" * 51)
    assert data_digest(path, tmp_path, image_hash_budget=10)["sha256"] != d["sha256"]
    (tmp_path / "imgs" / "b.png").unlink()
    assert data_digest(path, tmp_path)["missing_images"] == 1


def _record(tmp_path: Path, **training) -> dict:
    return run_record(
        _job(**training),
        servers=["127.0.0.1:5001", "127.0.0.1:5002"],
        sync_mode="full",
        world_size=2,
        model_dir=_model(tmp_path / "m"),
        data_path=_data(tmp_path / "d"),
        image_root=None,
        eval_data_path=tmp_path / "d" / "train.jsonl",
    )


def test_run_record_contents(tmp_path: Path) -> None:
    rec = _record(tmp_path, seed=7, prompts_per_step=6)
    assert rec["servers"] == ["127.0.0.1:5001", "127.0.0.1:5002"]
    assert (rec["sync_mode"], rec["world_size"]) == ("full", 2)
    assert rec["seeds"]["data_order"] == 7
    assert rec["seeds"]["rollout"]["seed"] == 0 and rec["seeds"]["rollout"]["stride"] == 6
    assert {"python", "torch", "transformers", "peft", "rmsft"} <= set(rec["packages"])
    assert rec["model"]["sha256"] and rec["data"]["sha256"] and rec["eval_data"]["sha256"]
    assert rec["job"]["spec"]["training"]["seed"] == 7
    assert rec["host"] and rec["started"].endswith("Z")
    json.dumps(rec)  # serialisable as it is


def test_write_keeps_earlier_runs_and_round_trips_the_job(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = _record(tmp_path, seed=1)
    path = write_run_record(ckpt, first)
    assert path == ckpt / RUN_FILE and not list(ckpt.glob(".*tmp*"))
    assert read_run_record(ckpt) == json.loads(json.dumps(first))

    write_run_record(ckpt, {**_record(tmp_path, seed=2), "resumed_from_step": 10})
    write_run_record(ckpt, _record(tmp_path, seed=3))
    now = read_run_record(path)
    assert now["seeds"]["data_order"] == 3
    assert [r["seeds"]["data_order"] for r in now["previous_runs"]] == [1, 2]
    assert now["previous_runs"][1]["resumed_from_step"] == 10
    assert all("previous_runs" not in r for r in now["previous_runs"])

    job = job_from_run_record(ckpt)  # the folder or the file
    assert job.to_manifest() == now["job"] == job_from_run_record(path).to_manifest()
    assert job.spec.training.seed == 3


def test_an_unreadable_earlier_record_is_moved_aside(tmp_path: Path) -> None:
    (tmp_path / RUN_FILE).write_text("{half a reco")
    write_run_record(tmp_path, {"format": 1, "job": {}})
    assert read_run_record(tmp_path) == {"format": 1, "job": {}}
    (aside,) = tmp_path.glob(f"{RUN_FILE}.unreadable-*")
    assert aside.read_text() == "{half a reco"


def test_job_from_a_bad_record_is_a_clear_error(tmp_path: Path) -> None:
    write_run_record(tmp_path / "a", {"format": 1})
    with pytest.raises(ValueError, match="no job manifest"):
        job_from_run_record(tmp_path / "a")
    manifest = _job().to_manifest()
    manifest["spec"]["training"]["nonsense"] = 1
    write_run_record(tmp_path / "b", {"job": manifest})
    with pytest.raises(JobSpecError, match="nonsense"):
        job_from_run_record(tmp_path / "b")
    with pytest.raises(FileNotFoundError):
        job_from_run_record(tmp_path / "c" / RUN_FILE)
