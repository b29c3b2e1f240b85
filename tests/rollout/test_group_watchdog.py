"""The weight group's deadline where the group has none of its own (issue 60, item 3: NCCL's collectives wait for
their peers for ever). `Watchdog` aborts the group when no operation completed within the deadline; the server
bounds its engine's group calls by `receive_bound_s` (`within`). Real threads and real waits here; the NCCL wiring
itself (ncclCommAbort as the abort) is tests/gpu/test_nccl_group_deadline_gpu.py's, on two GPUs."""

from __future__ import annotations

import threading
import time

import pytest

from rmsft.weight_wire.transfer import MembersLate, Watchdog, plan_buckets, receive_bound_s
from rollout_engine.engine import EngineDead
from rollout_svc.weight_group import within


def test_operations_that_keep_completing_outlast_the_deadline_without_an_abort() -> None:
    aborted = threading.Event()
    t0 = time.monotonic()
    with Watchdog(0.3, "broadcast 1", aborted.set) as dog:
        for i in range(10):  # 10 x 0.1 s: three times the deadline in all, never 0.3 s without progress
            time.sleep(0.1)
            dog.kick(f"broadcast {i + 2}")
    assert time.monotonic() - t0 >= 0.9
    assert not aborted.is_set() and not dog.expired and dog.kicks == 10


def test_an_operation_that_never_completes_is_aborted_at_the_deadline_and_named() -> None:
    """The body blocks as a host thread synchronising with a stuck collective does; the abort (ncclCommAbort's
    stand-in) is what releases it, and the block then raises MembersLate naming the operation it was on."""
    released = threading.Event()
    calls = []

    def abort() -> None:
        calls.append(time.monotonic())
        released.set()

    t0 = time.monotonic()
    late = r"did not finish broadcast 3 within the group's deadline of 0.5s"
    with pytest.raises(MembersLate, match=late), Watchdog(0.5, "broadcast 1", abort) as dog:
        dog.kick("broadcast 2")
        dog.kick("broadcast 3")
        assert released.wait(10), "the watchdog never aborted"
    assert len(calls) == 1
    assert 0.45 <= calls[0] - t0 < 3.0


def test_the_bodys_own_error_after_the_abort_is_the_cause() -> None:
    released = threading.Event()
    with pytest.raises(MembersLate) as caught, Watchdog(0.2, "the update's first broadcast", released.set):
        released.wait(10)
        raise RuntimeError("NCCL error: remote process exited or there was a network error")
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_body_that_finishes_in_time_leaves_no_watchdog_behind() -> None:
    before = {t.name for t in threading.enumerate()}
    with Watchdog(5.0, "broadcast 1", lambda: pytest.fail("aborted")):
        pass
    assert "rmsft-group-watchdog" not in {t.name for t in threading.enumerate()} - before


def test_the_receive_bound_is_the_deadline_for_each_collective_and_the_start_and_finish() -> None:
    sizes = [10, 20, 30, 1000, 5]
    assert len(plan_buckets(sizes, 64)) == 3  # [10, 20, 30], [1000], [5]
    assert receive_bound_s(2.0, sizes, 64) == 2.0 * (3 + 2)
    assert receive_bound_s(2.0, sizes, 0) == 2.0 * (5 + 2)  # one broadcast per tensor


def test_within_returns_what_the_call_returns_and_raises_what_it_raises() -> None:
    assert within(5.0, "joining", lambda: 42) == 42
    with pytest.raises(ValueError, match="bad listing"):
        within(5.0, "joining", lambda: (_ for _ in ()).throw(ValueError("bad listing")))


def test_within_gives_up_on_a_stuck_call_as_a_dead_engine() -> None:
    stuck = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(EngineDead, match=r"receiving the update .* did not end within 0.4s"):
        within(0.4, "receiving the update over the weight-transfer group", lambda: stuck.wait(30))
    assert time.monotonic() - t0 < 5
    stuck.set()
