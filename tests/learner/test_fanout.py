"""The weight-stream fan-out: every consumer sees every item; a consumer that goes away never blocks
the others; an encoder error reaches every consumer."""

from __future__ import annotations

import threading

import pytest

from learner.fanout import Fanout


def _drain(it, out: list, n: int | None = None) -> None:
    for k, x in enumerate(it):
        if n is not None and k >= n:
            break
        out.append(x)


def test_every_consumer_gets_every_item_in_order() -> None:
    fan = Fanout(iter(range(200)), 3, depth=2)
    outs = [[], [], []]
    threads = [threading.Thread(target=_drain, args=(fan.consumer(i), outs[i])) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert outs == [list(range(200))] * 3


def test_a_consumer_that_goes_away_does_not_block_the_others() -> None:
    fan = Fanout(iter(range(500)), 2, depth=1)
    slow_quitter, keeper = [], []
    quitter = fan.consumer(0)
    t = threading.Thread(target=_drain, args=(fan.consumer(1), keeper))
    t.start()
    _drain(quitter, slow_quitter, n=3)
    fan.close(0)  # e.g. its RPC failed; gRPC just stops iterating
    t.join(10)
    assert not t.is_alive() and keeper == list(range(500))


def test_source_error_reaches_every_consumer() -> None:
    def source():
        yield 1
        raise ValueError("tensor on a lost device")

    fan = Fanout(source(), 2)
    for i in range(2):
        with pytest.raises(RuntimeError, match="lost device"):
            list(fan.consumer(i))
    assert isinstance(fan.error, ValueError)
