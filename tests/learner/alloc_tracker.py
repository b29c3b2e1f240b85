"""Counts the tensor memory a piece of code allocates and keeps, as a torch dispatch mode: every
aten op run under the mode is seen, so the count includes what a library (peft's merge, the wire
encoder) allocates on the code's behalf, not only what the code itself creates.

A tensor storage is counted from the op that created it (an output whose storage is none of the
op's inputs' storages: views and in-place ops create nothing) until it is freed (weakly
referenced, checked at every op, so a storage freed between two ops is off the books before the
next allocation is counted). `peak` is the most bytes alive at once. Scratch memory an op frees
before it returns is not seen. Modes are per thread: enter it in the thread that runs the code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0  # bytes of tracked storages alive after the last op
        self.peak = 0
        self.allocated = 0  # bytes ever allocated under the mode

    def _prune(self) -> None:
        for key, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.current -= nbytes

    def live_bytes(self) -> int:
        self._prune()
        return self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        self._prune()
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._live:
                continue
            nbytes = storage.nbytes()
            self._live[key] = (StorageWeakRef(storage), nbytes)
            self.current += nbytes
            self.allocated += nbytes
        self.peak = max(self.peak, self.current)
        return out
