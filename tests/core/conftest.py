from __future__ import annotations

import pytest
from core_helpers import fused_vocab

from learner.core.vocab import VocabView


@pytest.fixture(scope="session")
def tiny_vocab(tiny_tokenizer) -> VocabView:
    return VocabView.from_hf_tokenizer(tiny_tokenizer)


@pytest.fixture(scope="session")
def fused() -> VocabView:
    return fused_vocab()
