"""The gate between Generate calls and weight applies (rollout_svc/runner.py), on fake engines: calls run
concurrently, an apply waits for the running calls and holds new ones, cancellation reaches the engine, a
bad prompt fails only its own call. The same rules on the real vLLM engine: tests/rollout/test_rollout_async.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from rmsft.weight_wire import WeightVersion
from rollout_engine.engine import EngineError, EngineInputError, GenItem, GenOutput, Sampling
from rollout_svc.runner import Cancelled, EngineRunner, RunnerStopped, VersionMismatch


class SubmitEngine:
    """Hands out a Future per call and finishes it only when the test says so (`release`)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[GenItem], Future]] = []
        self.lock = threading.Lock()
        self.cancelled: list[Future] = []

    def submit(self, items: list[GenItem]) -> Future:
        fut: Future = Future()
        fut.add_done_callback(lambda f: f.cancelled() and self.cancelled.append(f))
        with self.lock:
            self.calls.append((items, fut))
        return fut

    def release(self, k: int, error: Exception | None = None) -> None:
        items, fut = self.calls[k]
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(
                [GenOutput(list(it.prompt_token_ids), [it.prompt_token_ids[0] + 1000], "stop") for it in items]
            )

    def wait_calls(self, n: int) -> None:
        _until(f"{n} engine calls", lambda: len(self.calls) >= n)


def _until(what: str, check) -> None:
    """Wait (10 s at most) for a state the runner reports, instead of sleeping and hoping it was reached."""
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.002)


def _item(first: int) -> GenItem:
    return GenItem([first, 1, 2], Sampling(max_tokens=4))


class Caller:
    """One Generate call on its own thread; `.result` is ("ok", value) or ("error", exception)."""

    def __init__(
        self, runner: EngineRunner, items: list[GenItem], expected: WeightVersion | None = None, on_cancel=None
    ) -> None:
        self.result: tuple[str, object] = ("pending", None)

        def run() -> None:
            try:
                self.result = ("ok", runner.generate(items, expected, on_cancel=on_cancel))
            except Exception as e:  # the test inspects it
                self.result = ("error", e)

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def join(self) -> tuple[str, object]:
        self.thread.join(10)
        assert not self.thread.is_alive()
        return self.result


def test_calls_reach_the_engine_while_others_run() -> None:
    engine = SubmitEngine()
    runner = EngineRunner(engine, WeightVersion("run1", 3))
    a = Caller(runner, [_item(1), _item(2)])
    engine.wait_calls(1)
    b = Caller(runner, [_item(3)])
    engine.wait_calls(2)  # the second call was handed over while the first still ran
    assert runner.running_calls == 2
    engine.release(1)
    engine.release(0)
    (ka, ra), (kb, rb) = a.join(), b.join()
    assert ka == kb == "ok"
    outs, version = ra
    assert version == WeightVersion("run1", 3) and [o.token_ids for o in outs] == [[1001], [1002]]
    assert [o.token_ids for o in rb[0]] == [[1003]]
    assert runner.running_calls == 0


def test_an_apply_drains_running_calls_and_holds_new_ones() -> None:
    engine = SubmitEngine()
    v1, v2 = WeightVersion("run1", 1), WeightVersion("run1", 2)
    runner = EngineRunner(engine, v1)
    running = Caller(runner, [_item(1)], expected=v1)
    engine.wait_calls(1)
    applied = threading.Event()

    def apply() -> None:
        assert runner.running_calls == 0, "an apply ran while a Generate call was running"
        runner.weights = v2
        applied.set()

    applier = threading.Thread(target=runner.call, args=(apply,))
    applier.start()
    _until("the apply waits at the gate", lambda: runner.applies == 1)
    assert not applied.is_set()  # waits for the running call
    late_old = Caller(runner, [_item(2)], expected=v1)  # arrives while the apply waits
    late_any = Caller(runner, [_item(3)])
    _until("both late calls held at the gate", lambda: runner.waiting_calls == 2)
    assert len(engine.calls) == 1  # neither was handed to the engine before the apply
    engine.release(0)
    applier.join(10)
    assert applied.is_set()
    kind, (outs, version) = running.join()
    assert kind == "ok" and version == v1  # produced by, and labelled with, the version it was admitted under
    kind, err = late_old.join()
    assert kind == "error" and isinstance(err, VersionMismatch) and (err.expected, err.actual) == (v1, v2)
    engine.wait_calls(2)
    engine.release(1)
    kind, (outs, version) = late_any.join()
    assert kind == "ok" and version == v2


def test_cancel_reaches_the_engine() -> None:
    engine = SubmitEngine()
    runner = EngineRunner(engine)
    callbacks: list = []
    caller = Caller(runner, [_item(1)], on_cancel=callbacks.append)
    engine.wait_calls(1)
    _until("the call registered its cancel callback", lambda: bool(callbacks))
    callbacks[0]()  # what grpc does when the client's deadline passes or it goes away
    kind, err = caller.join()
    assert kind == "error" and isinstance(err, Cancelled)
    assert engine.cancelled == [engine.calls[0][1]]
    assert runner.running_calls == 0


def test_stop_aborts_running_calls_and_refuses_new_ones() -> None:
    engine = SubmitEngine()
    runner = EngineRunner(engine)
    caller = Caller(runner, [_item(1)])
    engine.wait_calls(1)
    runner.stop()
    kind, err = caller.join()
    assert kind == "error" and isinstance(err, RunnerStopped)
    assert engine.cancelled
    with pytest.raises(RunnerStopped):
        runner.generate([_item(2)], None)
    with pytest.raises(RunnerStopped):
        runner.call(lambda: None)


@pytest.mark.parametrize("error", [EngineInputError("prompt expands past max_model_len"), EngineError("boom")])
def test_an_engine_error_fails_only_its_own_call(error: Exception) -> None:
    engine = SubmitEngine()
    runner = EngineRunner(engine)
    bad = Caller(runner, [_item(666)])
    engine.wait_calls(1)
    good = Caller(runner, [_item(1)])
    engine.wait_calls(2)
    engine.release(0, error)
    engine.release(1)
    kind, err = bad.join()
    assert kind == "error" and err is error
    assert good.join()[0] == "ok"


class GenerateOnlyEngine:
    """An engine without `submit` (the HF backend): not thread-safe, so the runner runs it one call at a time."""

    def __init__(self) -> None:
        self.active = 0
        self.most = 0
        self.lock = threading.Lock()

    def generate(self, items: list[GenItem]) -> list[GenOutput]:
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        time.sleep(0.02)
        with self.lock:
            self.active -= 1
        return [GenOutput(list(it.prompt_token_ids), [7], "stop") for it in items]


def test_a_generate_only_engine_runs_one_call_at_a_time() -> None:
    engine = GenerateOnlyEngine()
    runner = EngineRunner(engine)
    callers = [Caller(runner, [_item(k)]) for k in range(6)]
    assert all(c.join()[0] == "ok" for c in callers)
    assert engine.most == 1
    runner.stop()


def test_a_call_whose_client_is_already_gone_is_aborted_at_once() -> None:
    engine = SubmitEngine()
    runner = EngineRunner(engine)
    # grpc's add_callback answers False when the RPC ended while the call waited at the gate.
    caller = Caller(runner, [_item(1)], on_cancel=lambda fn: False)
    kind, err = caller.join()
    assert kind == "error" and isinstance(err, Cancelled)
    assert engine.cancelled == [engine.calls[0][1]]


def test_stop_is_not_blocked_by_an_apply_that_hangs() -> None:
    """A weight apply stuck on a dying engine must not keep the server from shutting down."""
    engine = SubmitEngine()
    runner = EngineRunner(engine)
    release, hanging = threading.Event(), threading.Event()
    applier = threading.Thread(target=runner.call, args=(lambda: (hanging.set(), release.wait(10)),), daemon=True)
    applier.start()
    assert hanging.wait(10), "the apply never ran"
    done = threading.Event()
    threading.Thread(target=lambda: (runner.stop(), done.set()), daemon=True).start()
    assert done.wait(2), "stop waited for the hanging apply"
    with pytest.raises(RunnerStopped):
        runner.generate([_item(1)], None)
    release.set()
    applier.join(5)


def test_the_same_number_of_another_run_is_another_version() -> None:
    """A weight version is (run id, number): a call fenced to v7 of one run is refused by a runner holding v7
    of another (a restarted learner counts from its checkpoint's number again), naming both."""
    engine = SubmitEngine()
    runner = EngineRunner(engine, WeightVersion("9b0e5d2c4a11", 7))
    kind, err = Caller(runner, [_item(1)], expected=WeightVersion("3fa2c1d09e77", 7)).join()
    assert kind == "error" and isinstance(err, VersionMismatch)
    assert str(err) == (
        "expected weight version 7 of run 3fa2c1d09e77, server has 7 of run 9b0e5d2c4a11 "
        "(same number, another run's weights)"
    )
    assert engine.calls == []  # nothing reached the engine
    ok = Caller(runner, [_item(2)], expected=WeightVersion("9b0e5d2c4a11", 7))
    engine.wait_calls(1)
    engine.release(0)
    kind, (_, version) = ok.join()
    assert kind == "ok" and version == WeightVersion("9b0e5d2c4a11", 7)


class PausingEngine(SubmitEngine):
    """A SubmitEngine that can pause its running requests (vLLM's pause_generation mode "keep") and records the
    order of pause, apply and resume."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def pause_keep(self) -> None:
        self.events.append("pause")

    def resume(self) -> None:
        self.events.append("resume")


def test_an_inflight_apply_pauses_running_calls_instead_of_draining_them() -> None:
    engine = PausingEngine()
    v1, v2, v3 = WeightVersion("run1", 1), WeightVersion("run1", 2), WeightVersion("run1", 3)
    runner = EngineRunner(engine, v1)
    running = Caller(runner, [_item(1)], expected=v1)
    engine.wait_calls(1)

    def apply() -> None:
        assert runner.running_calls == 1 and runner.keeping  # the call is paused in the engine, not drained
        engine.events.append("apply")
        runner.weights = v2

    runner.call(apply, keep=True)  # returns with the call still running: nothing waited for it
    assert engine.events == ["pause", "apply", "resume"] and not runner.keeping
    # A call of the batch ahead that reached the gate during that apply (fenced to v1) still runs, on the new
    # weights, reported under the version it was fenced to; the version served is accepted too.
    late = Caller(runner, [_item(2)], expected=v1)
    engine.wait_calls(2)
    fresh = Caller(runner, [_item(3)], expected=v2)
    engine.wait_calls(3)
    for k in range(3):
        engine.release(k)
    assert running.join()[0] == "ok" and running.result[1][1] == v1
    assert late.join()[0] == "ok" and late.result[1][1] == v1
    assert fresh.join()[0] == "ok" and fresh.result[1][1] == v2
    # The next apply, drained this time, ends that grace: v1 is refused now, v2 too after it moved on.
    runner.call(lambda: setattr(runner, "weights", v3))
    assert not runner.accepts(v1) and not runner.accepts(v2) and runner.accepts(v3)
    kind, err = Caller(runner, [_item(4)], expected=v2).join()
    assert kind == "error" and isinstance(err, VersionMismatch)


def test_an_engine_that_cannot_pause_is_drained_even_when_asked_to_keep() -> None:
    engine = SubmitEngine()
    v1, v2 = WeightVersion("run1", 1), WeightVersion("run1", 2)
    runner = EngineRunner(engine, v1)
    running = Caller(runner, [_item(1)], expected=v1)
    engine.wait_calls(1)
    assert not runner.can_keep
    applier = threading.Thread(
        target=runner.call, args=(lambda: setattr(runner, "weights", v2),), kwargs={"keep": True}
    )
    applier.start()
    time.sleep(0.1)
    assert runner.weights == v1  # still waiting for the running call
    engine.release(0)
    applier.join(10)
    assert runner.weights == v2 and running.join()[0] == "ok"
    assert not runner.accepts(v1)  # drained: no grace for the old version


def test_the_servicer_maps_engine_labels_to_version_spans() -> None:
    from rollout_engine.engine import GenOutput
    from rollout_svc.servicer import RolloutServicer

    v0, v1, v2 = WeightVersion("", 0), WeightVersion("run1", 1), WeightVersion("run1", 2)
    servicer = object.__new__(RolloutServicer)  # `_spans` reads the label table alone
    servicer._labels = {"default": v0, "w1": v1, "w2": v2}
    out = GenOutput([1], list(range(10)), "length", None, [("w1", 0, 4), ("w2", 4, 10)])
    assert servicer._spans(out, v1) == [(v1, 0, 4), (v2, 4, 10)]
    # The same version relabelled (a drained apply of the same weights) is one span.
    servicer._labels["w3"] = v2
    out = GenOutput([1], list(range(10)), "length", None, [("w1", 0, 4), ("w2", 4, 7), ("w3", 7, 10)])
    assert servicer._spans(out, v1) == [(v1, 0, 4), (v2, 4, 10)]
    # No labels (the HF engine), or spans that do not cover the tokens: one span of the admitted version.
    assert servicer._spans(GenOutput([1], [5, 6], "stop"), v2) == [(v2, 0, 2)]
    assert servicer._spans(GenOutput([1], [5, 6, 7], "stop", None, [("w2", 1, 3)]), v2) == [(v2, 0, 3)]
    assert servicer._spans(GenOutput([1], [], "stop"), v2) == []
