"""Per-job serialisation of reconcile passes: no overlap, no lost event, bursts coalesce."""

from __future__ import annotations

import threading
import time

import pytest
from rmsft_operator.serial import PerKeyRunner


def test_events_during_a_pass_fold_into_exactly_one_more_pass() -> None:
    runner = PerKeyRunner()
    started, release = threading.Event(), threading.Event()
    passes: list[int] = []
    active = {"n": 0, "max": 0}

    def fn(index: int) -> str:
        active["n"] += 1
        active["max"] = max(active["max"], active["n"])
        passes.append(index)
        if index == 0:
            started.set()
            release.wait(5)
        active["n"] -= 1
        return f"pass {index}"

    result: dict[str, object] = {}
    t = threading.Thread(target=lambda: result.setdefault("r", runner.run("job", fn, wait=True)))
    t.start()
    assert started.wait(5)
    # a burst of child events while the first pass runs: none of them runs a pass itself
    assert [runner.run("job", fn, wait=False) for _ in range(5)] == [None] * 5
    release.set()
    t.join(5)
    assert not t.is_alive()  # the waiting caller came back (a lost wake-up would hang it)
    assert passes == [0, 1]  # one extra pass covers the whole burst
    assert result["r"] == "pass 1"  # the caller gets the latest outcome
    assert active["max"] == 1


def test_waiting_callers_run_one_after_another_and_keys_are_independent() -> None:
    runner = PerKeyRunner()
    active: dict[str, int] = {"a": 0, "b": 0}
    overlap = {"a": 0}
    both = threading.Event()
    calls: list[str] = []

    def make(key: str):
        def fn(index: int) -> None:
            calls.append(key)
            active[key] += 1
            overlap[key] = max(overlap.get(key, 0), active[key])
            if active["a"] and active["b"]:
                both.set()
            time.sleep(0.05)
            active[key] -= 1

        return fn

    threads = [threading.Thread(target=runner.run, args=(k, make(k), True)) for k in "aaab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert [t.is_alive() for t in threads] == [False] * 4  # every waiting caller got its turn
    assert sorted(calls) == ["a", "a", "a", "b"]  # one pass each: a waiting caller is never folded away
    assert overlap["a"] == 1  # same key never overlaps
    assert both.is_set()  # different keys do run side by side


def test_a_failing_pass_releases_the_key() -> None:
    runner = PerKeyRunner()

    def boom(index: int) -> None:
        raise RuntimeError("api down")

    with pytest.raises(RuntimeError):
        runner.run("job", boom, wait=True)
    assert runner.run("job", lambda i: "ok", wait=False) == "ok"
