from __future__ import annotations

from pathlib import Path

import pytest
from shm_sweep import ShmSweep
from suite_clock import SuiteClock
from suite_clock import pytest_addoption as pytest_addoption  # the budget's ini key (rmsft_suite_budget_s)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SuiteClock(config), "rmsft-suite-clock")
    config.pluginmanager.register(ShmSweep(), "rmsft-shm-sweep")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Qwen2 + CoordExp tokenizer, built once per session (a few seconds)."""
    from rmsft_dev.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session", params=["qwen3_vl", "qwen2_5_vl"])
def tiny_vl_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random vision-language model folder (processor included), once per architecture."""
    from rmsft.vl_processor import register
    from rmsft_dev.tiny_vl import build_tiny_vl_model

    register()
    return build_tiny_vl_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), arch=request.param)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-VL alone (tests that need one vision-language model, not both families)."""
    from rmsft.vl_processor import register
    from rmsft_dev.tiny_vl import build_tiny_vl_model

    register()
    return build_tiny_vl_model(tmp_path_factory.mktemp("tiny-qwen3_vl-only"), arch="qwen3_vl")


@pytest.fixture(scope="session")
def tokenizer_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two model folders without weights, enough for checks that read only config.json and the tokenizer
    files: "coordexp" (the tiny tokenizer with the 1000 coord tokens) and "stock" (the same one without them,
    as a stock checkpoint comes). Their configs have as many embedding rows as the coordexp vocabulary."""
    import json

    from rmsft_dev.tiny_model import build_tokenizer

    out = {}
    for name, coords in (("coordexp", True), ("stock", False)):
        folder = tmp_path_factory.mktemp(f"tokenizer-{name}")
        tok = build_tokenizer(0, coord_tokens=coords)
        tok.save_pretrained(folder)
        rows = len(build_tokenizer(0, coord_tokens=True)) if not coords else len(tok)
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": rows}))
        out[name] = folder
    return out
