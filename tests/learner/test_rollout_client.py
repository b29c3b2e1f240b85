"""Rollout client against real gRPC servers on loopback (fake engines, no vLLM)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from learner_fakes import FAKE_RUN, FakeEngine, FakeServer, fake_tokens

from learner.rollouts.client import (
    NoServerAvailableError,
    RolloutClient,
    RolloutError,
    RolloutRequest,
    StaleRolloutError,
    split_into_chunks,
)
from learner.rollouts.pool import ServerPool
from learner.rollouts.requests import MAX_CHUNK_BYTES
from learner.tracking.metrics import ROLLOUT_RETRIES
from rmsft.weight_wire import WeightVersion


@pytest.fixture
def cluster():
    """Factory: cluster(n, **engine_kwargs) -> (servers, pool); everything stopped afterwards."""
    made: list[tuple[list[FakeServer], ServerPool]] = []

    def make(n: int, version: int = 1, token: str | None = None, **kw):
        servers = [FakeServer(FakeEngine(ordinal=i, version=version, **kw)) for i in range(n)]
        # The engines hold `version` of FAKE_RUN: as if this pool's run had synced them.
        pool = ServerPool([s.address for s in servers], auth_token=token, reprobe_interval_s=0.0, run_id=FAKE_RUN)
        pool.set_current_version(version)
        made.append((servers, pool))
        return servers, pool

    yield make
    for servers, pool in made:
        pool.close()
        for s in servers:
            s.stop()


def requests(n: int, seed0: int = 100) -> list[RolloutRequest]:
    return [RolloutRequest(token_ids=[i % 7 + 1, i, 3], seed=seed0 + i, request_id=f"r{i}") for i in range(n)]


def assert_complete(out, reqs, version: int = 1) -> None:
    assert [r.request_id for r in out] == [q.request_id for q in reqs]
    for r, q in zip(out, reqs, strict=True):
        assert r.prompt_token_ids == list(q.token_ids)
        assert r.token_ids == fake_tokens(list(q.token_ids), q.seed)
        assert r.weight_version == version


def retries() -> float:
    return sum(s.value for m in ROLLOUT_RETRIES.collect() for s in m.samples if s.name.endswith("_total"))


# -- planning -------------------------------------------------------------------------------------
@given(st.integers(0, 300), st.integers(1, 9), st.integers(0, 17))
def test_plan_is_contiguous_balanced_and_bounded(n: int, k: int, batch: int) -> None:
    chunks = split_into_chunks(n, k, batch)
    assert [c.start for c in chunks] == ([0] + [c.stop for c in chunks[:-1]] if chunks else [])
    assert (chunks[-1].stop if chunks else 0) == n
    shares = [sum(len(c) for c in chunks if c.slot == s) for s in range(k)]
    assert max(shares) - min(shares) <= 1 and shares == sorted(shares, reverse=True)
    assert [c.slot for c in chunks] == sorted(c.slot for c in chunks)
    assert all(len(c) > 0 for c in chunks)
    if batch:
        assert all(len(c) <= batch for c in chunks)
        for s in range(k):  # pieces of one share differ by at most one
            sizes = [len(c) for c in chunks if c.slot == s]
            assert not sizes or max(sizes) - min(sizes) <= 1


@given(st.lists(st.integers(1, 50), min_size=0, max_size=60), st.integers(1, 5), st.integers(0, 7), st.integers(1, 120))
def test_plan_cuts_by_bytes_only_where_needed(sizes: list[int], k: int, batch: int, max_bytes: int) -> None:
    chunks = split_into_chunks(len(sizes), k, batch, sizes, max_bytes)
    assert (chunks[-1].stop if chunks else 0) == len(sizes)
    assert [c.start for c in chunks] == ([0] + [c.stop for c in chunks[:-1]] if chunks else [])
    plain = split_into_chunks(len(sizes), k, batch)
    for c in chunks:  # a chunk is over the bound only when it holds a single prompt that is
        assert sum(sizes[c.start : c.stop]) <= max_bytes or len(c) == 1
        # every cut lies inside one piece of the plan without the bound: same shares, same batch pieces
        assert any(p.start <= c.start and c.stop <= p.stop and p.slot == c.slot for p in plain)
    for a, b in zip(chunks, chunks[1:], strict=False):  # cut only where the next prompt would not fit
        if a.slot == b.slot and any(p.start <= a.start and b.stop <= p.stop for p in plain):
            assert sum(sizes[a.start : a.stop + 1]) > max_bytes


def test_plan_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one server"):
        split_into_chunks(3, 0)
    with pytest.raises(ValueError, match="batch_size"):
        split_into_chunks(3, 1, -1)


# -- ordering and splitting -----------------------------------------------------------------------
def test_order_and_contiguous_split_over_ordered_servers(cluster) -> None:
    servers, pool = cluster(3)
    reqs = requests(10)
    out = RolloutClient(pool).generate(reqs, {"max_tokens": 8, "temperature": 1.0})
    assert_complete(out, reqs)
    got = [[rid for call in s.engine.calls for rid, _ in call] for s in servers]
    assert got == [[f"r{i}" for i in range(0, 4)], [f"r{i}" for i in range(4, 7)], [f"r{i}" for i in range(7, 10)]]
    seeds = [seed for s in servers for call in s.engine.calls for _, seed in call]
    assert seeds == [q.seed for q in reqs]
    assert [r.server for r in out] == [servers[0].address] * 4 + [servers[1].address] * 3 + [servers[2].address] * 3


@pytest.mark.parametrize("inflight", [1, 2])
def test_generate_batch_size_splits_further_and_bounds_calls_in_flight(cluster, inflight) -> None:
    servers, pool = cluster(2, delay_s=0.05)
    reqs = requests(10)
    out = RolloutClient(pool, generate_batch_size=2, max_inflight_per_server=inflight).generate(reqs)
    assert_complete(out, reqs)
    assert [[len(c) for c in s.engine.calls] for s in servers] == [[2, 2, 1], [2, 2, 1]]
    assert all(s.engine.max_inflight == inflight for s in servers)


def test_by_default_each_server_gets_its_whole_share_in_one_call(cluster) -> None:
    servers, pool = cluster(2)
    reqs = requests(300)
    assert_complete(RolloutClient(pool).generate(reqs), reqs)
    assert [[len(c) for c in s.engine.calls] for s in servers] == [[150], [150]]


def test_a_share_too_big_for_one_message_is_cut(cluster) -> None:
    servers, pool = cluster(1)
    big = [
        RolloutRequest(messages=[("user", "look")], images=[bytes(7 << 20)], seed=i, request_id=f"r{i}")
        for i in range(5)
    ]  # 35 MiB of images: more than one Generate call may carry (MAX_CHUNK_BYTES)
    out = RolloutClient(pool).generate(big)
    assert [r.request_id for r in out] == [q.request_id for q in big]
    assert sorted(len(c) for c in servers[0].engine.calls) == [1, 2, 2]  # (the calls run concurrently)


def test_a_share_whose_replies_would_be_too_big_is_cut(cluster) -> None:
    servers, pool = cluster(1)
    reqs = requests(300)
    # 16 samples of up to 4096 tokens each: ~200 KB of reply per prompt, 60 MB for the share in one reply.
    out = RolloutClient(pool).generate(reqs, {"max_tokens": 4096, "temperature": 1.0, "n": 16})
    assert len(out) == 300 * 16
    sizes = sorted(len(c) for c in servers[0].engine.calls)
    assert sum(sizes) == 300 and len(sizes) >= 4
    assert max(sizes) * 16 * (3 * 3 + 3 * 4096) <= MAX_CHUNK_BYTES


def test_n_samples_come_back_in_order_and_reproduce_after_failover(cluster) -> None:
    servers, pool = cluster(2)
    reqs = requests(6)
    sampling = {"max_tokens": 8, "temperature": 1.0, "n": 3, "logprobs": True}
    healthy = RolloutClient(pool).generate(reqs, sampling)
    assert [(r.request_id, r.sample_index) for r in healthy] == [(q.request_id, k) for q in reqs for k in range(3)]
    assert all(r.logprobs == [-0.5] * len(r.token_ids) for r in healthy)
    assert len({tuple(r.token_ids) for r in healthy}) == 18  # each sample its own seed
    servers[0].engine.fail_generate = grpc.StatusCode.UNAVAILABLE  # server 0 dies: its share moves to server 1
    failed_over = RolloutClient(pool).generate(reqs, sampling)
    assert {r.server for r in failed_over} == {servers[1].address}
    assert [(r.request_id, r.sample_index, r.token_ids) for r in failed_over] == [
        (r.request_id, r.sample_index, r.token_ids) for r in healthy
    ]
    assert all(r.logprobs is None for r in RolloutClient(pool).generate(reqs[:1], {"max_tokens": 4, "n": 2}))


def test_servers_run_concurrently(cluster) -> None:
    servers, pool = cluster(4, delay_s=0.3)
    t0 = time.perf_counter()
    RolloutClient(pool).generate(requests(8))
    assert time.perf_counter() - t0 < 0.3 * 2.5  # sequential would take 4 x 0.3 s


def test_zero_requests_is_a_no_op(cluster) -> None:
    servers, pool = cluster(2)
    assert RolloutClient(pool).generate([]) == []
    assert all(not s.engine.calls for s in servers)


def test_fewer_prompts_than_servers(cluster) -> None:
    servers, pool = cluster(4)
    reqs = requests(2)
    assert_complete(RolloutClient(pool).generate(reqs), reqs)
    assert [len(s.engine.calls) for s in servers] == [1, 1, 0, 0]


def test_auth_token_is_sent(cluster) -> None:
    servers, pool = cluster(2, token="s3cret")
    reqs = requests(4)
    assert_complete(RolloutClient(pool).generate(reqs), reqs)
    assert all(md.get("authorization") == "Bearer s3cret" for s in servers for md in s.engine.metadata)


def test_bad_sampling_params_are_a_clear_error(cluster) -> None:
    _, pool = cluster(1)
    with pytest.raises(ValueError, match="unknown sampling parameter.*max_new_tokens"):
        RolloutClient(pool).generate(requests(2), {"max_new_tokens": 3})


# -- failover -------------------------------------------------------------------------------------
def test_dead_server_chunk_is_retried_with_same_seeds(cluster) -> None:
    servers, pool = cluster(3)
    pool.refresh()
    reqs = requests(12)
    servers[1].stop()  # the pool still believes it is up
    before = retries()
    out = RolloutClient(pool).generate(reqs)
    assert_complete(out, reqs)
    assert retries() > before
    answered = [rid for s in (servers[0], servers[2]) for call in s.engine.calls for rid, _ in call]
    assert sorted(answered) == sorted(q.request_id for q in reqs)  # nothing lost or duplicated
    seeds = {rid: seed for s in servers for call in s.engine.calls for rid, seed in call}
    assert seeds == {q.request_id: q.seed for q in reqs}
    assert not pool.servers[1].state.up and "UNAVAILABLE" in pool.servers[1].state.last_error


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN])
def test_failing_server_mid_batch_is_retried_elsewhere(cluster, code) -> None:
    servers, pool = cluster(2, delay_s=0.01)
    servers[0].engine.fail_generate = code
    servers[0].engine.fail_times = 1
    reqs = requests(9)
    before = retries()
    out = RolloutClient(pool, generate_batch_size=2).generate(reqs)
    assert_complete(out, reqs)
    assert retries() == before + 1
    failed = [rid for rid, _ in servers[0].engine.calls[0]]
    assert [r.server for r in out if r.request_id in failed] == [servers[1].address] * len(failed)
    answered = [rid for s in servers for call in s.engine.calls for rid, _ in call]
    # the failed chunk was asked twice (once failing); every other prompt exactly once
    assert sorted(set(answered)) == sorted(q.request_id for q in reqs)
    assert len(answered) == len(reqs) + len(servers[0].engine.calls[0])


def test_deadline_exceeded_is_retried_on_another_server(cluster) -> None:
    servers, pool = cluster(2)
    servers[0].engine.delay_s = 2.0
    reqs = requests(6)
    t0 = time.perf_counter()
    out = RolloutClient(pool, timeout_s=0.3).generate(reqs)
    assert time.perf_counter() - t0 < 1.5
    assert_complete(out, reqs)
    assert "DEADLINE_EXCEEDED" in pool.servers[0].state.last_error
    assert all(r.server == servers[1].address for r in out)


def test_server_killed_during_generate(cluster) -> None:
    servers, pool = cluster(2, delay_s=0.5)
    reqs = requests(8)
    killer = threading.Timer(0.15, servers[0].stop)
    killer.start()
    out = RolloutClient(pool).generate(reqs)
    killer.join()
    assert_complete(out, reqs)
    assert all(r.server == servers[1].address for r in out)


def test_invalid_argument_is_not_retried(cluster) -> None:
    servers, pool = cluster(2)
    servers[0].engine.fail_generate = grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(RolloutError, match="INVALID_ARGUMENT.*not retried"):
        RolloutClient(pool).generate(requests(4))


def test_all_servers_down_names_each_server_and_its_error(cluster) -> None:
    servers, pool = cluster(2)
    for s in servers:
        s.stop()
    with pytest.raises(NoServerAvailableError) as info:
        RolloutClient(pool).generate(requests(4))
    msg = str(info.value)
    for s in servers:
        assert s.address in msg
    assert "UNAVAILABLE" in msg


def test_every_server_failing_gives_a_clear_error(cluster) -> None:
    servers, pool = cluster(2, fail_generate=grpc.StatusCode.INTERNAL)
    with pytest.raises(RolloutError, match="INTERNAL") as info:
        RolloutClient(pool).generate(requests(4))
    assert all(s.address in str(info.value) for s in servers)


# -- the only server restarted (issue 41: spec.rollout.recoveryTimeout) -------------------------------------------
def _restarting(servers: list, i: int, down_at: float, up_after: float) -> threading.Thread:
    """Stops server i at `down_at` s and starts a new one (base weights, version 0) on its port `up_after` s later."""

    def run() -> None:
        time.sleep(down_at)
        servers[i].stop()
        time.sleep(up_after)
        servers[i] = servers[i].restart()

    t = threading.Thread(target=run)
    t.start()
    return t


def _resync_into(servers: list, pool: ServerPool, done: list) -> object:
    def resync(server) -> None:
        done.append(server.index)
        servers[server.index].engine.hold(pool.current)  # what a re-sync leaves

    return resync


@pytest.mark.parametrize("down_at", [0.0, 0.15], ids=["before-the-call", "mid-call"])
def test_a_restart_of_the_only_server_is_waited_out_and_it_is_resynced_first(cluster, down_at) -> None:
    servers, pool = cluster(1, delay_s=0.4)
    pool.recovery_s = 30.0
    resynced: list[int] = []
    t = _restarting(servers, 0, down_at, 1.0)
    if not down_at:
        time.sleep(0.2)  # down before the call starts
    reqs = requests(6)
    t0 = time.monotonic()
    out = RolloutClient(pool, resync=_resync_into(servers, pool, resynced)).generate(reqs)
    t.join()
    # Every prompt answered, with its own seed's tokens and the learner's version: by the restarted server, which was
    # re-synced (it came back on base weights) before it got any work.
    assert_complete(out, reqs)
    assert resynced == [0] and time.monotonic() - t0 >= 0.8
    assert servers[0].engine.calls and all(r.server == servers[0].address for r in out)


def test_a_server_that_does_not_come_back_in_time_fails_the_call(cluster) -> None:
    servers, pool = cluster(1)
    pool.recovery_s = 1.0
    servers[0].stop()
    t0 = time.monotonic()
    with pytest.raises(NoServerAvailableError, match=servers[0].address.replace(".", r"\.")):
        RolloutClient(pool).generate(requests(2))
    assert 1.0 <= time.monotonic() - t0 < 10.0
    pool.recovery_s = 0.0  # not waited for at all (the pool's default)
    t0 = time.monotonic()
    with pytest.raises(NoServerAvailableError):
        RolloutClient(pool).generate(requests(2))
    assert time.monotonic() - t0 < 1.0


# -- weight-version fencing -----------------------------------------------------------------------
def test_stale_completions_are_never_returned(cluster) -> None:
    servers, pool = cluster(2, reply_version=0)  # servers that ignore expected_weight_version
    with pytest.raises(StaleRolloutError, match="weight version 1"):
        RolloutClient(pool).generate(requests(4))


def test_stale_server_without_resync_is_skipped(cluster) -> None:
    servers, pool = cluster(2)
    servers[1].engine.reply_version = 0
    reqs = requests(6)
    out = RolloutClient(pool).generate(reqs)
    assert_complete(out, reqs)
    assert all(r.server == servers[0].address for r in out)


def test_failed_precondition_server_is_resynced_before_more_work(cluster) -> None:
    servers, pool = cluster(2)
    servers[1].engine.version = 0  # e.g. a restarted pod: pool does not know yet
    resynced = []

    def resync(server):
        resynced.append(server.address)
        servers[server.index].engine.hold(pool.current)  # what a re-sync leaves

    reqs = requests(8)
    out = RolloutClient(pool, resync=resync, generate_batch_size=1).generate(reqs)
    assert_complete(out, reqs)
    assert resynced == [servers[1].address]
    assert pool.servers[1].state.version == 1 and pool.servers[1].state.up
    # after its FAILED_PRECONDITION the server was re-synced, then answered with the current version
    assert any(r.server == servers[1].address for r in out)


def test_wrong_version_in_reply_triggers_resync(cluster) -> None:
    servers, pool = cluster(2)
    servers[0].engine.reply_version = 0
    resynced = []

    def resync(server):
        resynced.append(server.index)
        servers[server.index].engine.reply_version = None

    reqs = requests(6)
    out = RolloutClient(pool, resync=resync).generate(reqs)
    assert_complete(out, reqs)  # every answer at the current version: the stale reply was never returned
    assert resynced == [0]  # the server whose reply had the wrong version, once


def test_server_reported_stale_by_status_is_resynced_before_it_gets_work(cluster) -> None:
    servers, pool = cluster(2)
    pool.refresh()
    servers[0].stop()
    RolloutClient(pool).generate(requests(2))  # notices the dead server
    assert not pool.servers[0].state.up
    servers[0] = servers[0].restart()  # back on base weights, version 0
    order = []

    def resync(server):
        order.append(("resync", list(servers[server.index].engine.events)))
        servers[server.index].engine.hold(pool.current)  # what a re-sync leaves

    reqs = requests(8)
    out = RolloutClient(pool, resync=resync).generate(reqs)
    assert_complete(out, reqs)
    assert order == [("resync", ["status"])]  # probed, then re-synced; no Generate before that
    assert [r.server for r in out[:4]] == [servers[0].address] * 4  # gets its planned share back


def test_another_runs_weights_under_the_same_number_are_stale(cluster) -> None:
    """A weight version is (run id, number): a server another learner run synced to the same number is
    refused by its fence, re-synced, and only then given work; nothing of the other run is returned."""
    servers, pool = cluster(2)
    servers[1].engine.hold(WeightVersion("otherrun0001", 1))
    # Server 1's refused prompts go to server 0 while it re-syncs. Server 0 answers nothing before that re-sync is back
    # and then turns its first call away as busy: that call's prompts go to the least loaded server, the re-synced
    # one, on any machine load. (A delay on server 0 alone was a race: a busy machine handed all eight to server 0
    # before the re-sync came back, seen in a fresh-clone run.)
    resynced_event = threading.Event()
    servers[0].engine.gate = resynced_event
    servers[0].engine.fail_generate, servers[0].engine.fail_times = grpc.StatusCode.RESOURCE_EXHAUSTED, 1
    pool.refresh()
    assert pool.is_current(pool.servers[0]) and not pool.is_current(pool.servers[1])
    pool.servers[1].state.hold(pool.current)  # as if the learner had not noticed: the server's fence refuses
    resynced = []

    def resync(server):
        resynced.append(server.address)
        servers[server.index].engine.hold(pool.current)  # what a re-sync leaves
        resynced_event.set()

    reqs = requests(8)
    out = RolloutClient(pool, resync=resync, generate_batch_size=1).generate(reqs)
    assert_complete(out, reqs)
    assert resynced == [servers[1].address]
    assert {r.weights for r in out} == {WeightVersion(FAKE_RUN, 1)}
    assert any(r.server == servers[1].address for r in out)


def test_refusals_of_chunks_sent_before_a_resync_do_not_count_against_it(cluster) -> None:
    """Every server holds another run's weights while the learner thinks them current (another learner synced
    them meanwhile), and each has several chunks in flight: all are refused. The first refusal starts the
    server's re-sync; the others were sent before it and say nothing about it: no server is given up on, and
    every chunk is served after the re-syncs."""
    servers, pool = cluster(2)
    pool.refresh()
    for s in servers:
        s.engine.hold(WeightVersion("otherrun0001", 1))
    resynced, given_up = [], []

    def resync(server):
        resynced.append(server.address)
        servers[server.index].engine.hold(pool.current)

    real_mark_down = pool.mark_down
    pool.mark_down = lambda server, error: (given_up.append((server.address, error)), real_mark_down(server, error))
    reqs = requests(8)  # 4 chunks per server, all in flight before the first refusal comes back
    out = RolloutClient(pool, resync=resync, generate_batch_size=1).generate(reqs)
    assert_complete(out, reqs)
    assert sorted(resynced) == sorted(s.address for s in servers)  # once each
    assert given_up == []


def test_completions_of_another_run_are_never_returned(cluster) -> None:
    servers, pool = cluster(2, reply_run_id="otherrun0001")  # ignore the fence: another run's v1
    with pytest.raises(StaleRolloutError, match=f"1 of run {FAKE_RUN}"):
        RolloutClient(pool).generate(requests(4))
    servers[0].engine.reply_run_id = None
    pool.refresh()  # server 0 reports this run's v1 again; server 1's replies stay another run's
    out = RolloutClient(pool).generate(requests(4))
    assert {r.server for r in out} == {servers[0].address} and {r.weight_run_id for r in out} == {FAKE_RUN}


def test_failed_resync_excludes_the_server(cluster) -> None:
    servers, pool = cluster(2)
    servers[1].engine.version = 0

    def resync(server):
        raise RuntimeError("stream rejected")

    reqs = requests(6)
    out = RolloutClient(pool, resync=resync).generate(reqs)
    assert_complete(out, reqs)
    assert "re-sync" in pool.servers[1].state.last_error and not pool.servers[1].state.up


def test_version_argument_must_match_the_pool(cluster) -> None:
    _, pool = cluster(1)
    with pytest.raises(ValueError, match="current version is 1"):
        RolloutClient(pool).generate(requests(2), weight_version=2)


def test_wait_ready_names_the_missing_server(cluster) -> None:
    servers, pool = cluster(2)
    assert len(pool.wait_ready(timeout_s=5)) == 2
    servers[1].stop()
    with pytest.raises(NoServerAvailableError, match=servers[1].address.replace(".", r"\.")):
        pool.wait_ready(timeout_s=0.5, poll_s=0.1)


@pytest.mark.parametrize("seed", range(12))
def test_random_faults_lose_and_duplicate_nothing(cluster, seed) -> None:
    """Several servers failing in different ways at once, including a retry landing on a server
    that fails too: the result is still every prompt once, in order, from the current version."""
    import random

    rng = random.Random(seed)
    servers, pool = cluster(4, delay_s=0.005)
    codes = [
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
    ]
    for s in rng.sample(servers, 3):  # one server always stays healthy
        s.engine.fail_generate = rng.choice(codes)
        s.engine.fail_times = rng.randint(1, 3)
    reqs = requests(rng.randint(5, 40), seed0=seed * 1000)
    out = RolloutClient(pool, generate_batch_size=rng.choice([0, 1, 3, 5])).generate(reqs)
    assert_complete(out, reqs)
    assert len({r.request_id for r in out}) == len(reqs)
