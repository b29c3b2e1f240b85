"""Rewards outside rmsft, for tests/learner/test_rewards.py: named by import path (`reward_plugins:...`) and
behind a faked `rmsft.rewards` entry point."""

from __future__ import annotations

import time

from learner.rewards.interface import RewardInput


def length_reward(inp: RewardInput) -> float:
    """A plain function: the completion's length in tokens."""
    return float(len(inp.token_ids))


class ScaledLength:
    """A class: instantiated with the spec's params."""

    name = "scaled_length"

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, inp: RewardInput) -> float:
        return self.scale * len(inp.token_ids)


def make_threshold(min_tokens: int):
    """A factory: called with the params, returns the reward."""

    def threshold(inp: RewardInput) -> float:
        return 1.0 if len(inp.token_ids) >= min_tokens else 0.0

    return threshold


def fails_on_bad(inp: RewardInput) -> float:
    if inp.record.id.startswith("bad"):
        raise KeyError("boom")
    return 1.0


def returns_nan(inp: RewardInput) -> float:
    return float("nan")


def slow_index(inp: RewardInput) -> float:
    """Finishes later for earlier samples, so a pool completes them out of order."""
    time.sleep(0.02 * (5 - inp.sample_index % 5))
    return float(inp.sample_index)


NOT_CALLABLE = 42


def odd_records_vary(inp: RewardInput) -> float:
    """Flat groups on purpose (GRPO dynamic sampling): the sample's index for a record `answer-<odd>`, 1 for the
    others, whatever the completion."""
    return float(inp.sample_index) if int(inp.record.id.rsplit("-", 1)[1]) % 2 else 1.0
