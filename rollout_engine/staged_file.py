"""Reading a staged weight file back: the engines load an update from the data file and JSON index that
`rollout_svc.staging.Stager` wrote (index: {"data": path, "mode": int, "tensors": [[name, dtype, shape,
start], ...]}).
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

from rmsft.weight_wire import torch_dtype


def iter_staged_tensors(index_path: str) -> Iterator[tuple]:
    """(name, tensor) pairs backed by a private mmap of the staged file (no copy until written)."""
    import torch

    index = json.loads(Path(index_path).read_text())
    size = os.path.getsize(index["data"])
    with open(index["data"], "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    for name, dtype, shape, start in index["tensors"]:
        dt = torch_dtype(dtype)
        numel = 1
        for d in shape:
            numel *= d
        if numel == 0:
            yield name, torch.empty(shape, dtype=dt)
        else:
            yield name, torch.frombuffer(mm, dtype=dt, count=numel, offset=start).reshape(shape)
