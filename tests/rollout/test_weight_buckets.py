"""Packed buckets on the weight-transfer group (issue 60 item 4): the plan both ends derive from the header's table,
the pack/unpack round trip, and a real gloo group (the learner's GlooSender and a member's `receive`, each on its own
thread with its own stateless group: the collectives are real gloo broadcasts over TCP) whose receiver ends with the
sender's tensors bit for bit after one broadcast per bucket."""

from __future__ import annotations

import threading

import pytest
import torch

from rmsft.weight_wire.transfer import (
    GlooSender,
    open_group,
    pack,
    plan_buckets,
    receive_whole,
    tensor_nbytes,
    unpack,
)


def _table(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
    return (
        [n for n, _ in tensors],
        [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        [list(t.shape) for _, t in tensors],
    )


def _mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        ("a.f32", torch.randn(10, 10, generator=g)),  # 400 B
        ("b.bf16", torch.randn(30, generator=g).to(torch.bfloat16)),  # 60 B
        ("c.empty", torch.empty(0, 4, dtype=torch.float16)),  # 0 B
        ("d.big", torch.randn(300, generator=g)),  # 1200 B: larger than a bucket
        ("e.i64", torch.arange(7, dtype=torch.int64)),  # 56 B
        ("f.u8", torch.randint(0, 255, (5, 3), generator=g, dtype=torch.uint8)),  # 15 B
        ("g.f16", torch.randn(2, 2, 2, generator=g).to(torch.float16)),  # 16 B
    ]


def test_plan_fills_buckets_in_order_and_a_tensor_larger_than_a_bucket_goes_alone() -> None:
    sizes = [400, 60, 0, 1200, 56, 15, 16]
    assert plan_buckets(sizes, 512) == [(0, 3), (3, 4), (4, 7)]
    assert plan_buckets(sizes, 0) == [(i, i + 1) for i in range(7)]  # 0: one collective per tensor
    assert plan_buckets(sizes, 1 << 20) == [(0, 7)]
    assert plan_buckets([], 512) == []
    assert plan_buckets([600, 600], 512) == [(0, 1), (1, 2)]  # each larger than a bucket: alone
    assert plan_buckets([256, 256, 1], 512) == [(0, 2), (2, 3)]  # exactly full, then the next one opens
    with pytest.raises(ValueError, match="bucket_bytes must be >= 0"):
        plan_buckets(sizes, -1)


def test_pack_then_unpack_by_the_table_round_trips_mixed_dtypes_bit_for_bit() -> None:
    tensors = _mixed()
    names, dtypes, shapes = _table(tensors)
    sizes = [tensor_nbytes(d, s) for d, s in zip(dtypes, shapes, strict=True)]
    assert sizes == [t.numel() * t.element_size() for _, t in tensors]
    got = {}
    for start, end in plan_buckets(sizes, 512):
        buffer = pack([t for _, t in tensors[start:end]])
        assert buffer.dtype == torch.uint8 and buffer.numel() == sum(sizes[start:end])
        got.update(zip(names[start:end], unpack(buffer.clone(), dtypes[start:end], shapes[start:end]), strict=True))
    for name, t in tensors:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name].view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    assert pack([]).numel() == 0 and unpack(pack([]), [], []) == []
    with pytest.raises(ValueError, match="holds 400 bytes"):
        unpack(pack([tensors[0][1], tensors[1][1]]), dtypes[:1], shapes[:1])  # a table that does not match


class _Counting:
    """A member's group that counts the broadcasts it takes part in."""

    def __init__(self, group) -> None:
        self.group, self.broadcasts = group, 0

    def broadcast(self, tensor, src):
        self.broadcasts += 1
        return self.group.broadcast(tensor, src)

    def send(self, tensors, dst, tag):  # the update's finish (rmsft.weight_wire.transfer.receive_whole)
        return self.group.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self.group.recv(tensors, src, tag)


@pytest.mark.parametrize("bucket_bytes", [512, 0, 1 << 20])
def test_a_bucketed_broadcast_over_gloo_gives_the_receiver_the_senders_tensors_one_collective_per_bucket(
    bucket_bytes: int,
) -> None:
    pytest.importorskip("vllm")  # the group is vLLM's stateless gloo helper, as in production
    tensors = _mixed()
    names, dtypes, shapes = _table(tensors)
    plan = plan_buckets([tensor_nbytes(d, s) for d, s in zip(dtypes, shapes, strict=True)], bucket_bytes)
    sender = GlooSender(2, timeout_s=20, bucket_bytes=bucket_bytes)
    member: dict = {}
    errors: list[BaseException] = []

    def receiver() -> None:
        try:
            member["group"] = _Counting(open_group("127.0.0.1", sender.port, 1, 2, 20))
            member["got"] = dict(receive_whole(member["group"], names, dtypes, shapes, bucket_bytes))
        except BaseException as e:  # reported on the test's thread
            errors.append(e)

    t = threading.Thread(target=receiver, daemon=True)
    t.start()
    sender.join()
    sent = sender.send(iter(tensors))
    t.join(30)
    sender.close()
    assert not t.is_alive() and not errors, errors
    assert sent == sum(t.numel() * t.element_size() for _, t in tensors)
    got = member["got"]
    assert list(got) == names
    for name, want in tensors:
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    # One collective per bucket that carries bytes (the empty tensor's own bucket, when per tensor, carries none).
    carrying = sum(1 for s, e in plan if any(tensors[i][1].numel() for i in range(s, e)))
    assert sender.collectives == member["group"].broadcasts == carrying
    assert carrying == {512: 3, 0: 6, 1 << 20: 1}[bucket_bytes]


def test_the_weight_sync_benchmark_runs_nccl_per_tensor_and_bucketed_as_two_cases(tmp_path) -> None:
    """benchmarks/weight_sync.py's `nccl_bucketed` is transport nccl with --bucket-mb buckets, `nccl` one broadcast
    per tensor: the one run compares the two (its RESULT line's bucketed_vs_per_tensor_N)."""
    from benchmark_module import load_benchmark

    from learner.rollouts.pool import ServerPool

    bench = load_benchmark("weight_sync")
    with ServerPool(["127.0.0.1:9"]) as pool:  # never called: the clients are only built
        bucketed = bench._client(pool, object(), "nccl_bucketed", tmp_path, 8)
        per_tensor = bench._client(pool, object(), "nccl", tmp_path, 8)
    assert bucketed.transport == per_tensor.transport == "nccl"
    assert (bucketed.group.bucket_bytes, per_tensor.group.bucket_bytes) == (8 << 20, 0)


def test_the_engines_init_info_carries_the_groups_bucket_size_on_both_backends() -> None:
    """What a server hands vLLM's `init_weight_transfer_engine`: rmsft's gloo engine reads `bucket_bytes`; vLLM's
    NCCL engine is told to run its packed consumer with the same bucket (and buffers) as the learner's producer."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from rmsft.weight_wire.transfer import NCCL_BUFFERS, worker_init_info
    from rollout_engine.weight_transfer_gloo import _engine_class

    def info(backend: str, bucket: int) -> dict:
        return worker_init_info(
            backend,
            master_address="10.0.0.1",
            master_port=29500,
            world_size=3,
            rank_offset=1,
            timeout_s=30,
            bucket_bytes=bucket,
        )

    assert _engine_class().init_info_cls(**info("rmsft_gloo", 512 << 20)).bucket_bytes == 512 << 20
    nccl = NCCLWeightTransferEngine.init_info_cls(**info("nccl", 512 << 20))
    assert (nccl.packed, nccl.packed_buffer_size_bytes, nccl.packed_num_buffers) == (True, 512 << 20, NCCL_BUFFERS)
    assert NCCLWeightTransferEngine.init_info_cls(**info("nccl", 0)).packed is False
