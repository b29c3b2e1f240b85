"""Transport nccl's weight-transfer group, both halves of what crosses it: the backends, what each side hands vLLM's
weight-transfer API, and the learner's rank-0 end.

Two backends, one control path (`JoinWeightGroup`, then an `UpdateWeights` header with `transfer_group`):
- "nccl": vLLM's own NCCL engine (`vllm/distributed/weight_transfer/nccl_engine.py`), GPUs only; the learner's
  rank 0 opens its end with vLLM's rendezvous and communicator (as its `trainer_init` does, with the group's
  deadline) and broadcasts from its CUDA device, packed with vLLM's own packed producer/consumer
  (`packed_tensor.py`: buckets of `packed_buffer_size_bytes`, two in flight) when the group's bucket size is set,
  else one tensor per broadcast.
- "rmsft_gloo": rmsft's gloo engine (`rollout_engine/weight_transfer_gloo.py`, registered in vLLM's registry from
  every engine worker), the CPU stand-in: the same calls on machines without a GPU (tests, `rmsft local` on the CPU).
  Its group is a stateless torch.distributed gloo group (vLLM's helper: a TCP store on the learner, no global
  process group touched on either side); the bytes travel as uint8 broadcasts (gloo has no bf16 on every build),
  packed into buckets (`plan_buckets`) when the group's bucket size is set.

Buckets (spec.sync.bucketMegabytes, issue 60): one collective per bucket instead of per tensor. Both ends derive the
same plan from the header's table alone (names, dtypes, shapes, in order): `plan_buckets` fills a bucket while the
next tensor fits, a tensor larger than a bucket goes alone, and each tensor's offset is the sum of the sizes before
it in its bucket. A bucket of zero bytes (only empty tensors) is not broadcast. The size is agreed when the group is
joined (JoinWeightGroupRequest.bucket_bytes, echoed in the reply), so a member that would unpack differently never
takes part in an update.

Deadlines (spec.sync.groupTimeoutSeconds, issue 60): every group operation (the join's rendezvous, each broadcast,
the finish) runs under the group's deadline on both ends: it is the gloo group's own timeout (every collective and
point-to-point op of the group fails past it), and the learner waits on each of its ops with it
(`Work.wait(timeout)`). The gloo group's update is whole or nothing: a member receives every bucket into buffers of
its own first, then says it has them (`finish`: one word to rank 0), and loads them only when rank 0 answers COMMIT,
which it sends only once every member said so within the deadline. A member that misses it (stopped, stalled, gone)
is named (`MembersLate`), the others are answered ABORT (they load nothing and serve the version they had), and the
learner's end is aborted (its sockets close), so the late member's next op fails when it runs again: it never loads
the update. (A member stalled after it said it had every bucket, before it read the COMMIT, loads the update whole
when it runs again: the two-generals corner; its version is then the learner's, never a part of one.)
NCCL has no timeout of its own (a collective's kernel waits for its peers for ever): there the learner's deadline is
a `Watchdog` that aborts its communicator when no operation completed within the deadline (MembersLate, as gloo's),
the rendezvous's store takes the deadline, and each server bounds its engine's join and receive (rollout_svc.
weight_group: past `receive_bound_s` it exits to be restarted; vLLM's NCCL engine loads as it receives, so a broken
update leaves nothing whole to serve).

The server is started with `--weight-transfer BACKEND` (vLLM needs the backend when the engine is created); the
learner picks the same from `spec.accelerator`. torch and vLLM are imported lazily.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

GLOO = "rmsft_gloo"
NCCL = "nccl"
BACKENDS = (NCCL, GLOO)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"weight-transfer backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


# vLLM's packed NCCL path keeps this many buckets in flight on each side; both ends must agree, so it is fixed here.
NCCL_BUFFERS = 2


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """Index ranges [start, end) of the tensors (their byte sizes, in the listing's order) that share a bucket.
    `bucket_bytes` 0: one bucket per tensor. A bucket takes tensors while they fit; a tensor larger than a bucket
    gets one of its own. Both ends call this on the header's table, so they agree without sending the plan."""
    if bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
    if bucket_bytes == 0:
        return [(i, i + 1) for i in range(len(sizes))]
    buckets: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, size in enumerate(sizes):
        if i > start and used + size > bucket_bytes:
            buckets.append((start, i))
            start, used = i, 0
        used += size
    if start < len(sizes):
        buckets.append((start, len(sizes)))
    return buckets


# A member's join may take this long past the group's deadline: the rendezvous, then the communicator's own init.
JOIN_SLACK_S = 30.0


def receive_bound_s(timeout_s: float, sizes: Sequence[int], bucket_bytes: int) -> float:
    """The longest a member's whole receive of one update can take when each of its operations (the collectives of
    the plan, the update's start and finish) ends within the group's deadline `timeout_s`: past it the member is
    stuck, not slow (a server bounds its engine's receive by it, rollout_svc.weight_group)."""
    return timeout_s * (len(plan_buckets(sizes, bucket_bytes)) + 2)


def pack(tensors: Sequence[Any]) -> Any:
    """One flat uint8 buffer holding `tensors`' bytes back to back (the bucket a collective carries)."""
    import torch

    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors])


def unpack(buffer: Any, dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[Any]:
    """The tensors of one bucket, by the table: each at the offset its predecessors' sizes add up to. The results
    are views of `buffer` (a fresh buffer per bucket, so nothing overwrites them), or a copy where the offset is
    not a multiple of the dtype's size (a uint8 tensor of odd length before a float one)."""
    import math

    import torch

    out, offset = [], 0
    for dtype_name, shape in zip(dtype_names, shapes, strict=True):
        dtype = getattr(torch, dtype_name)
        n = math.prod(shape) * dtype.itemsize
        piece = buffer[offset : offset + n]
        if offset % dtype.itemsize:  # after an odd-sized tensor: a view would be misaligned, so this one is a copy
            piece = piece.clone()
        out.append(piece.view(dtype).view(list(shape)))
        offset += n
    if offset != buffer.numel():
        raise ValueError(f"a bucket of {buffer.numel()} bytes holds {offset} bytes of the listed tensors")
    return out


def tensor_nbytes(dtype_name: str, shape: Sequence[int]) -> int:
    import math

    import torch

    dtype: torch.dtype = getattr(torch, dtype_name)
    return math.prod(shape) * dtype.itemsize


def worker_init_info(
    backend: str,
    *,
    master_address: str,
    master_port: int,
    world_size: int,
    rank_offset: int,
    timeout_s: float,
    bucket_bytes: int = 0,
) -> dict[str, Any]:
    """`init_weight_transfer_engine`'s init_info for one server, whose workers take ranks rank_offset..
    `bucket_bytes`: the group's bucket size (0: one broadcast per tensor)."""
    check_backend(backend)
    info: dict[str, Any] = {
        "master_address": master_address,
        "master_port": master_port,
        "world_size": world_size,
        "rank_offset": rank_offset,
    }
    if backend == GLOO:
        info["timeout_s"] = timeout_s
        info["bucket_bytes"] = bucket_bytes
    else:
        # vLLM's NCCL engine packs when told to, with its own packed consumer; its bucket rule (flush once a
        # bucket passes the size) is vLLM's, the same on both ends because the learner uses vLLM's producer.
        info["packed"] = bucket_bytes > 0
        if bucket_bytes > 0:
            info["packed_buffer_size_bytes"] = bucket_bytes
            info["packed_num_buffers"] = NCCL_BUFFERS
    return info


def update_info(backend: str, specs: Sequence[tuple[str, Any]], also_as: dict[str, str]) -> dict[str, Any]:
    """`update_weights`' update_info for the listed tensors ((name, TensorSpec) pairs, in broadcast order).
    `also_as`: name -> a second name to load the same tensor under (rmsft's gloo engine only; the tied head)."""
    check_backend(backend)
    from rmsft.weight_wire import torch_dtype

    info: dict[str, Any] = {
        "names": [name for name, _ in specs],
        "dtype_names": [str(torch_dtype(spec.dtype)).removeprefix("torch.") for _, spec in specs],
        "shapes": [[int(d) for d in spec.shape] for _, spec in specs],
    }
    if backend == GLOO and also_as:
        info["also_as"] = dict(also_as)
    return info


class Watchdog:
    """A deadline for a group whose operations have none of their own (NCCL: a collective's kernel waits for its
    peers for ever, and a host thread synchronising its stream with it). Used as `with Watchdog(...) as dog:`
    around a run of operations, calling `dog.kick()` each time one of them completes: when `timeout_s` passes
    with no kick, `abort` runs once on the watchdog's thread (ncclCommAbort: the kernels still in a collective end
    and the host's waits return), and leaving the block raises MembersLate for `operation` (which member held it
    up, an NCCL collective cannot say: the servers' answers do, learner.sync.group). The block's own exception,
    if it raised one after the abort, becomes the cause."""

    def __init__(self, timeout_s: float, operation: str, abort: Any) -> None:
        import threading

        self.timeout_s, self.operation, self._abort = timeout_s, operation, abort
        self.expired = False
        self.kicks = 0
        self._cv = threading.Condition()
        self._done = False
        self._last = 0.0
        self._thread = threading.Thread(target=self._watch, name="rmsft-group-watchdog", daemon=True)

    def kick(self, what: str = "") -> None:
        """One operation completed: the next has `timeout_s` from now."""
        import time

        with self._cv:
            self._last = time.monotonic()
            self.kicks += 1
            if what:
                self.operation = what

    def _watch(self) -> None:
        import time

        with self._cv:
            while not self._done:
                left = self._last + self.timeout_s - time.monotonic()
                if left <= 0:
                    self.expired = True
                    break
                self._cv.wait(left)
        if self.expired:
            self._abort()

    def __enter__(self) -> Watchdog:
        import time

        self._last = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        with self._cv:
            self._done = True
            self._cv.notify_all()
        self._thread.join()
        if self.expired:
            raise MembersLate((), self.operation, self.timeout_s) from exc


class NcclSender:
    """The learner's end of an NCCL group (rank 0), built on vLLM's own parts (its StatelessProcessGroup rendezvous
    and PyNcclCommunicator, as its `trainer_init` builds them) so that the rendezvous takes the group's deadline
    (`trainer_init` fixes its store's timeout at 300 s). `port` must be free on this host: the rendezvous binds it
    itself when `join` runs.

    NCCL has no deadline of its own: every operation here runs under a `Watchdog` of `timeout_s` that aborts the
    communicator (ncclCommAbort) when no operation completed for that long, so a member lost or stopped mid-update
    fails the learner's send with MembersLate within the deadline instead of hanging it. The members' side of the
    same deadline is the server's (rollout_svc.weight_group: its engine's receive bounded, past which it exits to
    be restarted)."""

    def __init__(
        self, world_size: int, timeout_s: float = 300.0, *, address: str, port: int, bucket_bytes: int = 0
    ) -> None:
        self.world_size, self.timeout_s, self.address, self.port = world_size, timeout_s, address, port
        self.bucket_bytes = bucket_bytes
        self.collectives = 0  # broadcasts (unpacked) or tensors handed to the packed producer by the last send
        self.group: Any = None

    def join(self) -> None:
        import math

        import torch
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.utils.nccl import unpinned_nccl_env

        store = StatelessProcessGroup.create(
            host=self.address,
            port=self.port,
            rank=0,
            world_size=self.world_size,
            store_timeout=max(1, math.ceil(self.timeout_s)),
        )
        with unpinned_nccl_env():
            # ncclCommInitRank and its warm-up all-reduce wait for every member: bounded by the group's join
            # (learner.sync.group waits for it at most the deadline and 30 s, then closes this end).
            self.group = PyNcclCommunicator(store, device=torch.accelerator.current_device_index())

    def _abort(self) -> None:
        group = self.group
        if group is not None:
            group.destroy()  # vLLM's: ncclCommAbort on a thread of its own, waited for 5 s

    def send(self, tensors: Iterable[tuple[str, Any]]) -> int:
        import torch

        self.collectives = 0
        with Watchdog(self.timeout_s, "the update's first broadcast", self._abort) as dog:
            if self.bucket_bytes > 0:
                total = self._send_packed(tensors, dog)
            else:
                total, done = 0, []
                stream = torch.cuda.current_stream()
                for _, t in tensors:
                    flat = t.detach().contiguous()  # NCCL sends numel elements from data_ptr: never a strided view
                    self.group.broadcast(flat, src=0, stream=stream)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves its __init__ untyped
                    event.record(stream)
                    done.append((event, flat))  # the tensor is held until its broadcast completed
                    total += flat.numel() * flat.element_size()
                for i, (event, _) in enumerate(done):
                    event.synchronize()  # returns once the collective completed, or once the watchdog aborted it
                    dog.kick(f"broadcast {i + 2}")
                    self.collectives += 1
        return total

    def _send_packed(self, tensors: Iterable[tuple[str, Any]], dog: Watchdog) -> int:
        """vLLM's packed producer, the exact counterpart of the packed consumer its NCCL engine runs. It waits for
        a bucket's broadcast before it reuses the bucket's buffer, so each tensor it asks for is progress."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        sent = [0]

        def counted() -> Any:
            for name, t in tensors:
                dog.kick(f"the broadcast after tensor {self.collectives}")
                self.collectives += 1
                sent[0] += t.numel() * t.element_size()
                yield name, t

        packed_nccl_broadcast_producer(
            iterator=counted(),
            group=self.group,
            src=0,
            post_iter_func=lambda item: item[1],
            buffer_size_bytes=self.bucket_bytes,
            num_buffers=NCCL_BUFFERS,
        )
        return sent[0]

    def close(self) -> None:
        self._abort()  # a communicator left open holds its peers' sockets and GPU memory
        self.group = None


def make_sender(backend: str, world_size: int, timeout_s: float, *, address: str, bucket_bytes: int = 0) -> Any:
    """The learner's rank-0 end for `backend`, its port chosen (`.port`); `join()` then meets the servers."""
    check_backend(backend)
    if backend == GLOO:
        return GlooSender(world_size, timeout_s, address=address, bucket_bytes=bucket_bytes)
    import socket

    with socket.socket() as s:  # vLLM's NCCL rendezvous binds the port itself: a free one, chosen now
        s.bind(("", 0))
        port = s.getsockname()[1]
    return NcclSender(world_size, timeout_s, address=address, port=port, bucket_bytes=bucket_bytes)


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float, listen_socket: Any = None) -> Any:
    """This process's member of a stateless gloo group (rank 0 hosts the rendezvous: a TCP store on `listen_socket`
    when given, so no other process can take its port between choosing it and listening)."""
    import datetime

    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        host,
        port,
        rank,
        world_size,
        backend="gloo",
        listen_socket=listen_socket,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


# The finish's words, rank 0 to each member (a float32 of one element: what every gloo build reduces and sends).
COMMIT, ABORT = 1.0, 0.0
FINISH_TAG = 7  # the finish's point-to-point messages (the group's only ones)
# In every "nothing loaded" error of a member: the engine reads it to tell such a failure (its model whole, its
# version the previous one) from one that left the model partly replaced.
NOTHING_LOADED = "nothing was loaded"


class GroupAborted(RuntimeError):
    """This member's update over the group ended before COMMIT: nothing of it was loaded."""


class MembersLate(RuntimeError):
    """Members (their group ranks) that did not finish a group operation within the group's deadline."""

    def __init__(self, ranks: Sequence[int], operation: str, timeout_s: float) -> None:
        self.ranks, self.operation, self.timeout_s = tuple(ranks), operation, timeout_s
        who = f"group rank(s) {', '.join(map(str, ranks))}" if ranks else "a member of the group"
        super().__init__(f"{who} did not finish {operation} within the group's deadline of {timeout_s:g}s")


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=max(seconds, 0.001))


def receive_whole(
    group: Any, names: list[str], dtype_names: list[str], shapes: list[list[int]], bucket_bytes: int = 0
) -> list[tuple[str, Any]]:
    """Every tensor of the update, held until rank 0 commits it (module doc: whole or nothing). Raises GroupAborted
    (nothing loaded: the caller's model is as it was) when rank 0 answers ABORT or any op of the group fails (its
    deadline passed, the learner's end closed)."""
    import torch

    try:
        tensors = list(receive(group, names, dtype_names, shapes, bucket_bytes))
        group.send([torch.ones(1)], 0, FINISH_TAG).wait()  # "I have every bucket"
        word = torch.zeros(1)
        group.recv([word], 0, FINISH_TAG).wait()
    except Exception as e:
        raise GroupAborted(f"the update over the weight-transfer group broke ({e}); {NOTHING_LOADED}") from e
    if word.item() != COMMIT:
        raise GroupAborted(
            f"the learner called the update off (another member missed the group's deadline); {NOTHING_LOADED}"
        )
    return tensors


def receive(
    group: Any, names: list[str], dtype_names: list[str], shapes: list[list[int]], bucket_bytes: int = 0
) -> Any:
    """(name, tensor) as each bucket arrives from rank 0, in the order the update listed them; `bucket_bytes` is the
    group's (the sender's) bucket size, so the plan here is the sender's."""
    import torch

    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError(f"the update lists {len(names)} names, {len(dtype_names)} dtypes and {len(shapes)} shapes")
    sizes = [tensor_nbytes(d, s) for d, s in zip(dtype_names, shapes, strict=True)]
    for start, end in plan_buckets(sizes, bucket_bytes):
        buffer = torch.empty(sum(sizes[start:end]), dtype=torch.uint8)
        if buffer.numel():  # the sender skips a bucket of empty tensors too
            group.broadcast(buffer, 0).wait()
        yield from zip(names[start:end], unpack(buffer, dtype_names[start:end], shapes[start:end]), strict=True)


class GlooSender:
    """The learner's side: rank 0 of the group, the rendezvous host. `join` blocks until every worker joined (call
    it while the engines' init_weight_transfer_engine calls run); `send` broadcasts the tensors in the order
    `describe` listed them (call it while the engines' update_weights calls run).

    `address` is the one the servers reach the learner at: every member names the rendezvous by the same
    address and port (the group's keys are prefixed with them). The learner listens on every interface; port 0
    picks a free one, held from now on (the socket listens already), so `port` is known before any server is told
    to join."""

    def __init__(
        self,
        world_size: int,
        timeout_s: float = 300.0,
        *,
        address: str = "127.0.0.1",
        port: int = 0,
        bucket_bytes: int = 0,
    ) -> None:
        import socket

        self.world_size, self.timeout_s, self.address = world_size, timeout_s, address
        self.bucket_bytes = bucket_bytes
        self.collectives = 0  # broadcasts issued by the last send (tests and the benchmark read it)
        self._listen: socket.socket | None = socket.create_server(("", port))
        self.port = self._listen.getsockname()[1]
        self.group: Any = None

    def join(self) -> None:
        try:
            self.group = open_group(
                self.address, self.port, 0, self.world_size, self.timeout_s, listen_socket=self._listen
            )
        finally:
            self._listen = None  # the store owns the socket now (or it failed with it)

    def close(self) -> None:
        if self._listen is not None:
            self._listen.close()
            self._listen = None
        if self.group is not None:
            # Closes its sockets now (not whenever the object is collected): a member still in an op of this group
            # fails at once, or when it runs again (a stopped one), instead of meeting a learner that went on.
            with contextlib.suppress(Exception):
                self.group.abort()
        self.group = None

    def send(self, tensors: Any) -> int:
        """`broadcast` then `finish`: the update whole on every member, or on none (module doc)."""
        total = self.broadcast(tensors)
        self.finish()
        return total

    def broadcast(self, tensors: Any) -> int:
        """Broadcast `tensors` ((name, tensor), in the listing's order) as they are produced, a bucket at a time
        (`plan_buckets`' rule, applied as they come: the receiver applies it to the whole listing); returns the
        bytes sent. Holds at most one bucket (or one tensor larger than a bucket) beyond the export's own."""
        self.collectives = 0
        total = 0
        pending: list[Any] = []
        used = 0
        for _, t in tensors:
            size = t.numel() * t.element_size()
            if pending and (self.bucket_bytes == 0 or used + size > self.bucket_bytes):
                total += self._broadcast(pending)
                pending, used = [], 0
            pending.append(t)
            used += size
        if pending:
            total += self._broadcast(pending)
        return total

    def _broadcast(self, bucket: list[Any]) -> int:
        flat = pack(bucket)
        if flat.numel():  # a bucket of empty tensors carries nothing: the receiver skips it too
            try:
                self.group.broadcast(flat, 0).wait(_timedelta(self.timeout_s))
            except Exception as e:  # which member held it up, a broadcast cannot say: the servers' answers do
                raise MembersLate((), f"broadcast {self.collectives + 1} ({e})", self.timeout_s) from e
            self.collectives += 1
        return int(flat.numel())

    def finish(self) -> None:
        """Every member says it holds every bucket within the deadline, then each is told COMMIT; otherwise the
        ones that said so are told ABORT and MembersLate names the rest (the caller closes the group)."""
        import time

        import torch

        deadline = time.monotonic() + self.timeout_s
        acks = {rank: torch.zeros(1) for rank in range(1, self.world_size)}
        works = {rank: self.group.recv([t], rank, FINISH_TAG) for rank, t in acks.items()}
        late = []
        for rank, work in works.items():
            try:
                work.wait(_timedelta(deadline - time.monotonic()))
            except Exception:
                late.append(rank)
        word = torch.full((1,), ABORT if late else COMMIT)
        for rank in acks:
            if rank in late:
                continue
            try:
                self.group.send([word], rank, FINISH_TAG).wait(_timedelta(deadline - time.monotonic()))
            except Exception:
                late.append(rank)
        if late:
            raise MembersLate(sorted(late), "the update's finish", self.timeout_s)
