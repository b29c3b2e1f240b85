"""In-flight weight updates on the learner's side (issue 63): the staleness bound counts an answer that spans weight
versions by its oldest tokens' version (and by the version its call was fenced to), a sync with
`rollout.inflight` does not drain the rollouts generating ahead, and the sync asks the servers to keep generating.
The server side: tests/rollout/test_runner.py (the gate), tests/rollout/test_rollout_inflight_vllm.py (vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from learner.rollouts.requests import Rollout
from learner.train.checkpointer import TrainState
from learner.train.feed import RolloutFeed
from rmsft.weight_wire import WeightVersion

RUN = "run-a"


def _feed(window: int, version: int, inflight: bool = True, ahead=None) -> RolloutFeed:
    feed = object.__new__(RolloutFeed)  # within_window and before_sync read the config, the state and `ahead` only
    feed.cfg = SimpleNamespace(rollout=SimpleNamespace(max_staleness=window, inflight=inflight))
    feed.state = TrainState(step=0, version=version, run_id=RUN)
    feed.ahead = ahead
    return feed


def _rollout(fenced: int, spans: list[tuple[int, int, int]], run: str = RUN) -> Rollout:
    return Rollout(
        "r0",
        [1, 2],
        list(range(10)),
        "length",
        fenced,
        "srv:1",
        weight_run_id=RUN,
        version_spans=[(WeightVersion(run, v), s, e) for v, s, e in spans],
    )


@pytest.mark.parametrize(
    ("window", "fenced", "spans", "ok"),
    [
        # learner at version 5
        (1, 4, [(4, 0, 6), (5, 6, 10)], True),  # oldest tokens one version behind: inside the window of 1
        (
            1,
            3,
            [(3, 0, 2), (4, 2, 6), (5, 6, 10)],
            False,
        ),  # 2 behind for its first 2 tokens: out, though most are newer
        (2, 3, [(3, 0, 2), (4, 2, 6), (5, 6, 10)], True),
        (1, 3, [(4, 0, 6), (5, 6, 10)], False),  # fenced to 3 (it waited at a gate): counted by the fence too
        (1, 4, [(4, 0, 6), (6, 6, 10)], False),  # a span newer than the learner: no such version of this run
        (0, 5, [(5, 0, 10)], True),
        (0, 4, [(4, 0, 3), (5, 3, 10)], False),  # max_staleness 0: every token from the current version
        (1, 4, [], True),  # a server that sends no spans: every token is its fenced version's
    ],
)
def test_the_staleness_bound_counts_an_answer_by_its_oldest_tokens(window, fenced, spans, ok) -> None:
    assert _feed(window, 5).within_window([_rollout(fenced, spans)]) is ok


def test_a_span_of_another_runs_weights_is_refused() -> None:
    r = _rollout(4, [(4, 0, 6)])
    r.version_spans.append((WeightVersion("run-b", 5), 6, 10))
    assert not _feed(1, 5).within_window([r])


def test_spans_and_newest_of_a_rollout() -> None:
    r = _rollout(4, [(4, 0, 6), (5, 6, 10)])
    assert r.weights == WeightVersion(RUN, 4) and r.newest == WeightVersion(RUN, 5)
    plain = _rollout(4, [])
    assert plain.spans == [(WeightVersion(RUN, 4), 0, 10)] and plain.newest == plain.weights
    del plain.version_spans  # a rollout pickled before spans existed (a checkpoint's batch ahead)
    assert plain.spans == [(WeightVersion(RUN, 4), 0, 10)]


class _Ahead:
    def __init__(self) -> None:
        self.drained = 0

    def pending(self) -> bool:
        return True

    def drain(self) -> None:
        self.drained += 1


@pytest.mark.parametrize("inflight", [False, True])
def test_a_sync_drains_the_batch_ahead_unless_updates_are_inflight(inflight: bool) -> None:
    ahead = _Ahead()
    _feed(1, 5, inflight=inflight, ahead=ahead).before_sync()
    assert ahead.drained == (0 if inflight else 1)
