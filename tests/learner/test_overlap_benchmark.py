"""benchmarks/overlap.py's `vl --spread` logic without servers: the lengths each prompt gets, the split of one
Generate call into one call per length put back in order, the spanning count and the RESULT line's ratios."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from benchmark_module import load_benchmark

from learner.rollouts.requests import Rollout, RolloutRequest
from rmsft.weight_wire.version import WeightVersion

bench = load_benchmark("overlap")


def _requests(n: int, base: int = 100) -> list[RolloutRequest]:
    return [RolloutRequest(token_ids=[1, 2], seed=base + i, request_id=f"r{i}") for i in range(n)]


def test_every_length_is_used_per_call_and_a_prompt_keeps_its_length() -> None:
    lengths = [16, 16, 32, 512]
    got = bench.spread_lengths(_requests(8), lengths)
    assert sorted(got) == sorted(lengths * 2)  # each length twice in a call of twice as many prompts
    # The same prompt (seed) gets the same length in another call with the same members, in another order.
    reordered = list(reversed(_requests(8)))
    assert list(reversed(bench.spread_lengths(reordered, lengths))) == got


def test_a_call_is_split_by_length_and_put_back_in_order() -> None:
    seen: list[tuple[list[int], int, int, int]] = []

    def generate(reqs, sampling, version):  # one rollout per sample: its seed and the length it was asked for
        seen.append(([r.seed for r in reqs], sampling.max_tokens, sampling.min_tokens, version))
        return [
            Rollout(f"{r.seed}/{k}", [], [0] * sampling.max_tokens, "length", version, "s", sample_index=k)
            for r in reqs
            for k in range(sampling.n)
        ]

    reqs = _requests(6)
    seconds: list[float] = []
    with ThreadPoolExecutor(3) as pool:
        out = bench.spread_generate(generate, [8, 64, 300], pool, seconds)(reqs, {"max_tokens": 96, "n": 2}, 7)
    want = bench.spread_lengths(reqs, [8, 64, 300])
    assert [r.request_id for r in out] == [f"{r.seed}/{k}" for r in reqs for k in range(2)]
    assert [len(r.token_ids) for r in out] == [w for w in want for _ in range(2)]
    assert sorted(s[1] for s in seen) == [8, 64, 300]  # one call per length, exactly that long, same fence
    assert all(mx == mn and v == 7 for _, mx, mn, v in seen)
    assert len(seconds) == 1


def test_spanning_counts_answers_of_more_than_one_version() -> None:
    v1, v2 = WeightVersion("run", 1), WeightVersion("run", 2)
    one = Rollout("a", [], [0] * 4, "stop", 1, "s", weight_run_id="run")
    both = Rollout("b", [], [0] * 4, "stop", 1, "s", weight_run_id="run", version_spans=[(v1, 0, 2), (v2, 2, 4)])
    history = [SimpleNamespace(rollouts=[one, both]), SimpleNamespace(rollouts=[both])]
    assert bench.spanning(history) == 2


def test_the_result_line_compares_drain_with_in_flight() -> None:
    args = bench.parser().parse_args(["vl", "--inflight", "--skip-sync", "--staleness", "2", "--spread", "8,64"])
    assert bench.vl_arms(args) == ["async", "inflight"]
    figures = {
        "wait": 1.0,
        "rate": 0.2,
        "wall": 30.0,
        "train": 4.0,
        "idle": 2.0,
        "drain": 1.0,
        "gen": 5.0,
        "spanning": 0,
    }
    out = {"async": figures, "inflight": {**figures, "wait": 0.25, "rate": 0.3, "idle": 0.5, "spanning": 3}}
    line = bench.vl_result(args, out)
    fields = dict(f.split("=", 1) for f in line.split()[1:])
    assert fields["staleness"] == "2" and fields["spread"] == "8,64" and "sync_wait_s" not in fields
    assert fields["inflight_spanning"] == "3" and fields["async_spanning"] == "0"
    assert float(fields["inflight_speedup_vs_async"]) == pytest.approx(1.5)
    assert float(fields["inflight_wait_saved_s"]) == pytest.approx(0.75)
    assert float(fields["inflight_pool_idle_vs_async"]) == pytest.approx(0.25)
