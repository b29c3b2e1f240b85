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


@pytest.fixture(scope="session")
def fused_plain() -> VocabView:
    """The fused vocabulary without coord tokens (what a plain-text format runs with)."""
    return fused_vocab(coord_tokens=False)


@pytest.fixture(scope="session")
def stock_tokenizer():
    """A real byte-level BPE tokenizer without the `<|coord_k|>` tokens, as a stock Qwen-VL comes."""
    from rmsft_dev.tiny_model import build_tokenizer

    return build_tokenizer(0, coord_tokens=False)


@pytest.fixture(scope="session")
def stock_vocab(stock_tokenizer) -> VocabView:
    return VocabView.from_hf_tokenizer(stock_tokenizer, coord_tokens=False)
