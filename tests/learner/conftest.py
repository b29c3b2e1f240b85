"""Fixtures of the tests that run the real trainer against fake rollout servers (a test module defining a fixture
of the same name uses its own)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from learner_fakes import FakeEngine, FakeServer, chat_renderer


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight synthetic text records."""
    from rmsft_dev.synthetic import write_synthetic_dataset

    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n=8, seed=0)


@pytest.fixture
def servers(tiny_model_dir: Path) -> Iterator[list[FakeServer]]:
    """Two fake rollout servers (real gRPC on loopback) that render prompts as the tiny model's server would."""
    render = chat_renderer(str(tiny_model_dir))
    made = [FakeServer(FakeEngine(ordinal=i, render=render)) for i in range(2)]
    yield made
    for s in made:
        s.stop()
