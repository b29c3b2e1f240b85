"""The staging preflight sizes a FULL update in the dtype the server serves in (`--dtype`): floating
checkpoint tensors in that dtype, float8 and integer tensors in their own."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from test_staging_preflight import header_only_model as _header_only_model

from rmsft.serving_dtype import serving_dtype_name
from rollout_svc.preflight import GIB, check_staging, weight_bytes

TENSORS = {"w": ("BF16", [1024, 1024]), "f8": ("F8_E4M3", [1024]), "steps": ("I64", [8])}


def test_serving_dtype_name(tmp_path: Path) -> None:
    bf16 = _header_only_model(tmp_path / "a", TENSORS, {"dtype": "bfloat16"})
    assert serving_dtype_name("auto", bf16) == "BF16"
    assert serving_dtype_name("float32", bf16) == "F32"
    legacy = _header_only_model(tmp_path / "b", TENSORS, {"text_config": {"torch_dtype": "float16"}})
    assert serving_dtype_name("auto", legacy) == "F16"
    bare = _header_only_model(tmp_path / "c", {**TENSORS, "small": ("F32", [16])}, {})
    assert serving_dtype_name("auto", bare) == "BF16"  # most floating bytes are BF16
    assert weight_bytes(bare) - weight_bytes(bare, "auto") == 16 * 2  # as stored vs all floats in BF16
    with pytest.raises(ValueError, match="--dtype must be auto or one of"):
        serving_dtype_name("fp8", bf16)


def test_weight_bytes_follow_the_serving_dtype(tmp_path: Path) -> None:
    model = _header_only_model(tmp_path / "m", TENSORS, {"dtype": "bfloat16"})
    fixed = 1024 * 1 + 8 * 8  # float8 and int64 keep their checkpoint dtype
    mib = 1 << 20
    assert weight_bytes(model) == weight_bytes(model, "auto") == weight_bytes(model, "bfloat16") == 2 * mib + fixed
    assert weight_bytes(model, "float32") == 4 * mib + fixed
    assert weight_bytes(model, "float16") == 2 * mib + fixed


def test_check_staging_sizes_for_the_serving_dtype(tmp_path: Path) -> None:
    # 2 GiB of bf16 weights: fits 4.5 GiB twice in bf16, not in float32 (8 GiB twice)
    model = _header_only_model(tmp_path / "m", {"w": ("BF16", [1 << 30])}, {"dtype": "bfloat16"})
    size = 4.5 * GIB
    statvfs = lambda path: SimpleNamespace(f_blocks=int(size) // 4096, f_frsize=4096)  # noqa: E731
    assert check_staging(str(model), str(tmp_path), statvfs=statvfs) is None
    assert check_staging(str(model), str(tmp_path), statvfs=statvfs, dtype="bfloat16") is None
    problem = check_staging(str(model), str(tmp_path), statvfs=statvfs, dtype="float32")
    assert problem and "needs about 8.0 GiB" in problem and "at least 8Gi" in problem
