"""The NCCL weight group's deadline (issue 60, item 3) on real GPUs: the learner's `NcclSender` (vLLM's rendezvous
and communicator, the group's deadline on its store and a `Watchdog` on every operation) and one member on a second
GPU that joins, takes the first broadcast and then stalls, as a server whose engine is stuck does. The learner's
send must end within the deadline with MembersLate (the watchdog's ncclCommAbort releasing the collective that waits
for the stalled member), not hang. A member's side (the server exits past `receive_bound_s`) is tested on the CPU
(tests/rollout/test_weight_transfer_gloo.py), as the watchdog's logic is (tests/rollout/test_group_watchdog.py).

Needs two CUDA devices (NCCL refuses two ranks of one communicator on one device) and vLLM (the GPU image has it;
`make gpu-check`'s wheels do not, so there it is skipped, saying so)."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import socket
import time
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (one NCCL rank per device)"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (the GPU image's)"),
]

DEADLINE = 10.0


def _member(port: int, stalled: Any) -> None:
    """Rank 1 on cuda:1: joins, receives the first broadcast, then stops taking part (never the second)."""
    import torch
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    torch.cuda.set_device(1)
    store = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=1, world_size=2)
    comm = PyNcclCommunicator(store, device=1)
    first = torch.empty(1 << 20, device="cuda:1")
    comm.broadcast(first, src=0, stream=torch.cuda.current_stream())
    torch.cuda.current_stream().synchronize()
    stalled.set()
    time.sleep(3600)


def test_a_member_stalled_mid_update_fails_the_learners_send_within_the_deadline() -> None:
    from rmsft.weight_wire.transfer import MembersLate, NcclSender

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    stalled = ctx.Event()
    member = ctx.Process(target=_member, args=(port, stalled), daemon=True)
    member.start()
    try:
        torch.cuda.set_device(0)
        sender = NcclSender(2, DEADLINE, address="127.0.0.1", port=port)
        sender.join()
        tensors = [("a", torch.ones(1 << 20, device="cuda:0")), ("b", torch.ones(1 << 20, device="cuda:0"))]
        t0 = time.monotonic()
        with pytest.raises(MembersLate, match=r"did not finish broadcast 2 within the group's deadline of 10s"):
            sender.send(tensors)
        took = time.monotonic() - t0
        assert stalled.is_set(), "the member never took the first broadcast"
        assert DEADLINE - 1 <= took < DEADLINE + 20, took  # the watchdog's abort, not a hang and not at once
        sender.close()
    finally:
        member.kill()
        member.join(10)
