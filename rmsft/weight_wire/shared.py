"""Transport shm: an update written once into node-local shared memory and read by every server.

Learner: `SharedUpdate.create(directory, specs, ...)` reserves the whole file up front (a full
filesystem fails here, before any server is called) and builds the header that names it; the
servers are called with that header, then `write(tensors)` fills the file tensor by tensor,
hashing what it writes, and the trailer carrying the digest ends every call. The learner removes
the file once every server answered (`remove`), whatever they answered.

Server: `open_shared(directory, header)` opens the named file when the header arrives (so the
update stays readable through that descriptor even once the learner removed the path) and
`check_shared(fd, header, trailer, reader)` reads it as if its bytes were the pieces of a gRPC
stream, through the same `StreamReader`: same names, shapes, dtypes, counts and digest rules,
same errors. A file that is shorter than announced, altered after the learner hashed it, or laid
out differently from its index is refused before anything reaches the engine.

What the digest does not cover: a writer changing the file after the servers verified it. The
learner never writes after sending the trailer (it has closed its descriptor by then).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rmsft_protos import rollout_pb2

from rmsft.weight_wire.contract import (
    DEFAULT_DIGEST,
    DEFAULT_FRAME_BYTES,
    DTYPE_SIZES,
    PipelinedDigest,
    SyncMode,
    TensorSpec,
    WireError,
)
from rmsft.weight_wire.receive import StreamReader
from rmsft.weight_wire.send import _checked, _flat_bytes, stream_header
from rmsft.weight_wire.version import NO_RUN

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Where learner and servers meet: set in both by `rmsft local` and by the operator (a node-local
# memory-backed directory mounted in the learner pod and every rollout pod).
SHARED_DIR_ENV = "RMSFT_SHARED_WEIGHTS_DIR"
FILE_PREFIX = "rmsft-update-"


def shared_dir_from_env() -> str:
    """The shared-weights directory this process was given, or "" (transport shm unavailable)."""
    return os.environ.get(SHARED_DIR_ENV, "")


class SharedSpaceError(OSError):
    """The shared directory cannot hold an update (a full or too small memory filesystem)."""


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at offset {offset}")
        view, offset = view[n:], offset + n


@dataclass
class SharedUpdate:
    """The learner's half: one update file, created by `create`, filled by `write`, gone after `remove`."""

    path: str
    header: rollout_pb2.WeightHeader
    specs: list[tuple[str, TensorSpec]]
    _fd: int = -1

    @classmethod
    def create(
        cls,
        directory: str | Path,
        specs: Sequence[tuple[str, TensorSpec]],
        *,
        number: int,
        mode: SyncMode,
        run_id: str = NO_RUN,
        adapter_config_json: str = "",
        digest: int = DEFAULT_DIGEST,
    ) -> SharedUpdate:
        specs = list(specs)
        header = stream_header(
            specs, number=number, run_id=run_id, mode=mode, adapter_config_json=adapter_config_json, digest=digest
        )
        directory = str(directory)
        path = os.path.join(directory, f"{FILE_PREFIX}v{number}-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin")
        # Readable by the servers, which may run as another user in their own pods.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.fchmod(fd, 0o644)  # the umask must not take the servers' read permission away
            # Checked, not reserved: reserving (fallocate) zero-fills every page first, which costs as
            # much as writing them (0.3 s/GiB here); a filesystem that fills up meanwhile fails a
            # write, which ends the update before any server applies it.
            free = shutil.disk_usage(directory).free
            if header.total_bytes > free:
                raise SharedSpaceError(
                    f"shared-weights dir {directory} has {free} bytes free; weight version {number} needs "
                    f"{header.total_bytes}"
                )
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        shared = header.shared_file
        shared.path = path
        start = 0
        for name, spec in specs:
            shared.tensors.add(name=name, dtype=spec.dtype, shape=spec.shape, start=start)
            start += spec.nbytes
        return cls(path, header, specs, fd)

    @staticmethod
    def leftovers(directory: str | Path) -> list[str]:
        """Update files in `directory` (to remove at a learner's start: only learners write there)."""
        return sorted(str(p) for p in Path(directory).glob(f"{FILE_PREFIX}*.bin"))

    def write(self, tensors: Iterable[tuple[str, torch.Tensor]], frame_bytes: int = DEFAULT_FRAME_BYTES) -> bytes:
        """Write `tensors` (the names, dtypes and shapes of `specs`, in order; a lazy producer is
        asked for the next one only once the previous one is written and hashed) and return the
        digest for the trailer. The file is closed for writing when this returns or raises."""
        hasher = PipelinedDigest(self.header.digest_algorithm)
        try:
            start = 0
            for _name, tensor, spec in _checked(self.specs, tensors):
                flat = _flat_bytes(tensor)
                del tensor
                for offset in range(0, flat.shape[0], frame_bytes):
                    frame = flat[offset : offset + frame_bytes]
                    try:
                        _pwrite_all(self._fd, frame, start + offset)
                    except OSError as e:
                        if e.errno in (errno.ENOSPC, errno.EDQUOT):
                            raise SharedSpaceError(
                                f"shared-weights dir {os.path.dirname(self.path)} filled up while writing: {e}"
                            ) from e
                        raise
                    hasher.update(frame)  # hashed on a helper thread while the next frame is written
                hasher.settle()  # the producer may reuse this tensor's memory once asked for the next
                del flat
                start += spec.nbytes
            return hasher.digest()
        finally:
            hasher.close()
            self._close()

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def remove(self) -> None:
        """Remove the file (servers still holding it open keep reading it; its memory is freed when
        the last one closes it)."""
        self._close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


# -- the server's half --------------------------------------------------------------------------


def shared_path(directory: str, header: rollout_pb2.WeightHeader) -> str:
    """The header's file, checked to be a plain name directly inside `directory` (a header must not
    make a server open anything else)."""
    if not directory:
        raise WireError(
            "this server has no shared-weights dir (start it with --shared-weights-dir or "
            "RMSFT_SHARED_WEIGHTS_DIR), so it cannot take a shm update; use transport grpc",
            code="FAILED_PRECONDITION",
            reason="shm_unavailable",
        )
    path = header.shared_file.path
    name = os.path.basename(path)
    if not name.startswith(FILE_PREFIX) or os.path.realpath(os.path.dirname(path)) != os.path.realpath(directory):
        raise WireError(
            f"shared update file {path!r} is not an rmsft update directly inside this server's shared-weights dir "
            f"{directory}: learner and server must mount the same directory (RMSFT_SHARED_WEIGHTS_DIR)",
            code="FAILED_PRECONDITION",
            reason="shm_path",
        )
    return os.path.join(directory, name)


def open_shared(directory: str, header: rollout_pb2.WeightHeader) -> int:
    """A read-only descriptor of the header's file (opened at once: the learner may remove the path
    after every server answered, and this descriptor keeps the bytes readable until closed)."""
    path = shared_path(directory, header)
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise WireError(
            f"cannot open shared update file {path}: {e}", code="FAILED_PRECONDITION", reason="shm_path"
        ) from e


@dataclass
class _PieceView:
    """What `StreamReader.on_piece` reads of a piece (name, dtype, shape, offset)."""

    name: str
    dtype: str
    shape: Sequence[int]
    offset: int


# Pieces a shm file is read in: big, so each hash `update` spreads over every core (the bytes are in
# memory already; the frame limit of a stream bounds what a receiver buffers, nothing to bound here).
SHARED_PIECE_BYTES = 256 << 20


def check_shared(
    fd: int,
    header: rollout_pb2.WeightHeader,
    trailer: rollout_pb2.WeightTrailer,
    reader: StreamReader,
    frame_bytes: int = SHARED_PIECE_BYTES,
) -> None:
    """Check the shared file behind `fd` as a stream: every tensor of the header's index, read in
    pieces of `frame_bytes`, goes through `reader` (which already took the header; its frame limit
    and digest are set here for a file), then the trailer's digest. Raises WireError; the file is
    only read."""
    size = os.fstat(fd).st_size
    if size != header.total_bytes:
        raise WireError(
            f"shared update file holds {size} bytes, the header announced {header.total_bytes} (truncated or replaced)",
            reason="truncated",
        )
    reader.max_frame_bytes = frame_bytes
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None
    data: memoryview | None = None
    buf: memoryview | None
    try:
        buf = memoryview(mm) if mm is not None else memoryview(b"")
        for entry in header.shared_file.tensors:
            # An unknown dtype counts as 0 bytes here and is refused by `on_piece` with its name.
            spec_bytes = TensorSpec(entry.dtype, tuple(entry.shape)).nbytes if entry.dtype in DTYPE_SIZES else 0
            offset = 0
            while True:  # a zero-size tensor is one empty piece, as on the wire
                n = min(frame_bytes, spec_bytes - offset)
                piece = _PieceView(entry.name, entry.dtype, entry.shape, offset)
                data = buf[entry.start + offset : entry.start + offset + n]
                if len(data) != max(n, 0):
                    raise WireError(f"tensor {entry.name!r} lies outside the shared file", reason="count")
                dest = reader.on_piece(piece, data)
                if dest != entry.start + offset:
                    raise WireError(
                        f"tensor {entry.name!r} starts at byte {entry.start} of the shared file; tensors must lie "
                        "back to back from byte 0 in index order",
                        reason="count",
                    )
                offset += n
                if offset >= spec_bytes:
                    break
        reader.on_trailer(trailer)
    finally:
        reader.close()  # no hash still reading the map
        data = buf = None  # views must go before the map closes
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view kept elsewhere: the GC closes it
                mm.close()
