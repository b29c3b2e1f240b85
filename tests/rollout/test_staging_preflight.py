"""`rmsft serve`'s staging preflight: a staging dir (/dev/shm in pods) too small for a FULL weight
sync fails the server at start, with the spec key to raise, instead of failing the first sync."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from rmsft.serving_dtype import safetensors_header
from rmsft.weight_wire import FULL, decode_chunk, encode_weight_stream
from rollout_engine.config import ServeConfig
from rollout_svc.preflight import (
    GIB,
    check_staging,
    staging_copies,
    staging_problem,
    weight_bytes,
    write_termination_log,
)

ROOT = Path(__file__).resolve().parents[2]


def fake_statvfs(total_bytes: int, frsize: int = 4096):
    return lambda path: SimpleNamespace(f_blocks=total_bytes // frsize, f_frsize=frsize)


def header_only_model(folder: Path, tensors: dict[str, tuple[str, list[int]]], config: dict | None = None) -> Path:
    """A model folder whose safetensors file has a header and no data: enough for the preflight,
    which must never read tensor bytes (a real 8 GiB model is read in milliseconds too)."""
    folder.mkdir(parents=True, exist_ok=True)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "F8_E4M3": 1}
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    (folder / "config.json").write_text(json.dumps(config or {}))
    return folder


# -- weight bytes from headers ----------------------------------------------------------------------
def test_weight_bytes_sum_every_shard_from_the_headers(tmp_path: Path) -> None:
    save_file(
        {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)},
        tmp_path / "model-1.safetensors",
        metadata={"format": "pt"},
    )
    save_file({"c": torch.zeros(2, 2, dtype=torch.int64)}, tmp_path / "model-2.safetensors")
    assert weight_bytes(tmp_path) == 3 * 4 * 4 + 5 * 2 + 2 * 2 * 8
    assert set(safetensors_header(tmp_path / "model-1.safetensors")) == {"__metadata__", "a", "b"}
    assert weight_bytes(tmp_path / "nothing-here") is None  # no safetensors: the engine says so itself


def test_weight_bytes_never_read_tensor_data(tmp_path: Path) -> None:
    model = header_only_model(tmp_path / "m", {"w": ("BF16", [4096, 1 << 20])})  # 8 GiB declared, 0 stored
    assert (model / "model.safetensors").stat().st_size < 4096
    assert weight_bytes(model) == 8 * GIB


def test_garbage_file_is_a_clear_problem(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    problem = check_staging(str(tmp_path), str(tmp_path), statvfs=fake_statvfs(GIB))
    assert problem and "model.safetensors is not a safetensors file" in problem


# -- the decision ---------------------------------------------------------------------------------------
def test_the_message_names_sizes_and_the_spec_key() -> None:
    weights = int(8.2 * GIB)
    assert staging_problem(weights, 8 * GIB, "/dev/shm") == (
        "staging dir /dev/shm has 8.0 GiB; a FULL weight sync of this model needs about 16.4 GiB "
        "(the update + a rollback copy): raise spec.rollout.shmSize to at least 17Gi"
    )
    assert staging_problem(weights, 17 * GIB, "/dev/shm") is None
    one = staging_problem(weights, 8 * GIB, "/dev/shm", copies=1)
    assert one and "needs about 8.2 GiB (the update)" in one and "at least 9Gi" in one
    elsewhere = staging_problem(weights, 8 * GIB, "/scratch/stage")
    assert elsewhere and elsewhere.endswith("(or point --staging-dir at a bigger filesystem)")


def test_check_staging_compares_twice_the_weights_with_the_filesystem_size(tmp_path: Path) -> None:
    model = header_only_model(tmp_path / "m", {"w": ("F32", [1 << 20, 256])})  # 1 GiB
    stage = tmp_path / "stage"
    stage.mkdir()
    assert check_staging(str(model), str(stage), statvfs=fake_statvfs(2 * GIB)) is None
    problem = check_staging(str(model), str(stage), statvfs=fake_statvfs(2 * GIB - 4096))
    assert problem and f"staging dir {stage} has 2.0 GiB" in problem and "at least 2Gi" in problem
    assert check_staging(str(model), str(stage), False, statvfs=fake_statvfs(GIB)) is None  # no rollback copy
    assert "does not exist" in check_staging(str(model), str(tmp_path / "absent"), statvfs=fake_statvfs(GIB))


def test_shm_servers_check_the_shared_dir_for_two_updates_instead_of_staging(tmp_path: Path) -> None:
    from rollout_svc.preflight import check_shared_dir

    model = header_only_model(tmp_path / "m", {"w": ("F32", [1 << 20, 256])})  # 1 GiB
    shared = tmp_path / "shared"
    shared.mkdir()
    assert check_shared_dir(str(model), str(shared), statvfs=fake_statvfs(2 * GIB)) is None
    problem = check_shared_dir(str(model), str(shared), statvfs=fake_statvfs(GIB))
    assert problem and f"shared-weights dir {shared} has 1.0 GiB" in problem
    assert "about 2.0 GiB" in problem and "spec.sync.transport: grpc" in problem
    assert "does not exist" in check_shared_dir(str(model), str(tmp_path / "absent"), statvfs=fake_statvfs(GIB))


def test_termination_log_is_written_only_where_it_exists(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.write_text("")
    assert write_termination_log("too small", str(log)) and log.read_text() == "too small\n"
    absent = tmp_path / "absent-log"
    assert not write_termination_log("too small", str(absent)) and not absent.exists()


# -- the factor is the servicer's real behaviour ---------------------------------------------------
class _StagingProbeEngine:
    """Engine stub that records the staging dir's bytes while a FULL update is applied (the
    moment the update and the previous rollback copy are both there)."""

    backend, lora_enabled, max_lora_rank, tensor_parallel_size = "stub", False, 0, 1

    def __init__(self, staging_dir: Path) -> None:
        self.staging_dir = staging_dir
        self.staged_bytes: list[int] = []

    def apply_full(self, index_path: str | None) -> None:
        self.staged_bytes.append(sum(p.stat().st_size for p in self.staging_dir.glob("*.bin")))

    def reset_prefix_cache(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Context:
    def is_active(self) -> bool:
        return True

    def abort(self, code: grpc.StatusCode, message: str):
        raise AssertionError(f"{code.name}: {message}")


@pytest.mark.parametrize("keep", [True, False])
def test_full_updates_hold_staging_copies_times_the_weights(tiny_model_dir: Path, tmp_path: Path, keep: bool) -> None:
    from rollout_svc.servicer import RolloutServicer

    cfg = ServeConfig(model=str(tiny_model_dir), backend="hf", staging_dir=str(tmp_path), keep_rollback_copy=keep)
    servicer = RolloutServicer(cfg)
    engine = _StagingProbeEngine(tmp_path)
    servicer.attach(engine)
    tensors = load_file(tiny_model_dir / "model.safetensors")
    try:
        for version in (1, 2, 3):
            _, requests = encode_weight_stream(tensors.items(), number=version, mode=FULL)
            servicer.UpdateWeights((decode_chunk(r) for r in requests), _Context())
    finally:
        servicer.close()
    wb = weight_bytes(tiny_model_dir)
    assert engine.staged_bytes[0] == wb  # the first update: the checkpoint is the rollback
    assert max(engine.staged_bytes) == staging_copies(keep) * wb


# -- `rmsft serve` ----------------------------------------------------------------------------------
def test_serve_exits_before_the_engine_when_staging_is_too_small(tmp_path: Path) -> None:
    # 4 TiB of declared weights: more than any staging filesystem this test can run on.
    model = header_only_model(tmp_path / "huge", {"w": ("F32", [1 << 20, 1 << 20])})
    stage = tmp_path / "stage"
    stage.mkdir()
    t0 = time.monotonic()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rmsft_cli",
            "serve",
            "--model",
            str(model),
            "--backend",
            "hf",
            "--staging-dir",
            str(stage),
            "--port",
            "0",
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "RMSFT_LOG_LEVEL": "info"},
    )
    assert res.returncode != 0
    assert f"rmsft serve: staging dir {stage} has" in res.stderr
    assert (
        "needs about 8192.0 GiB (the update + a rollback copy): raise spec.rollout.shmSize to at least 8192Gi"
        in res.stderr
    )
    assert "listening on" not in res.stderr and "Traceback" not in res.stderr
    assert time.monotonic() - t0 < 60


def test_preflight_writes_the_termination_message(tmp_path: Path) -> None:
    from rollout_svc import server

    model = header_only_model(tmp_path / "huge", {"w": ("F32", [1 << 20, 1 << 20])})
    log = tmp_path / "termination-log"
    log.write_text("")
    cfg = ServeConfig(model=str(model), backend="hf", staging_dir=str(tmp_path))
    with pytest.raises(SystemExit, match="raise spec.rollout.shmSize"):
        server.preflight(cfg, termination_log=str(log))
    assert log.read_text().startswith(f"rmsft serve: staging dir {tmp_path} has ")
