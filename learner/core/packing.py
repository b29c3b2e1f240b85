"""Post-rollout packing: a carry buffer of segments, one padding-free row per call.

Public API
- `Packer(packing_length, packing_buffer, min_fill=0.0)`; `.add(segments)` (all or nothing);
  `.next_row() -> PackedRow | None`; `.pending`, `.pending_tokens`, `.pending_lengths`.
- `pack(segments) -> PackedRow`: concatenate given segments (also used for one-segment rows).
- `PackedRow`: tensors `input_ids`, `position_ids`, `labels` (shape [1, L]), `coord_positions`,
  `coord_bins` ([n], positions already shifted by each segment's offset), `segments`
  (`SegmentInfo(offset, length, coord_start, coord_end, meta)`), `fill`. `.to(device)`;
  `model(**row.model_inputs())` runs it (no attention mask, `use_cache=False`: both required).
- Errors: `SegmentTooLongError` (a segment longer than packing_length), `BufferFullError`
  (adding would hold more than packing_buffer segments); nothing is added when either is raised.

Selection: the oldest segment is always taken (nothing starves); the rest of the row is an exact
subset-sum over the other buffered segments (a bitset DP over lengths: the buffer is small, the
capacity is a few thousand to tens of thousands, so this is fast and optimal for the row), ties
broken towards older segments. `benchmarks/packing.py` compares it with FIFO-greedy and
`binpacking.to_constant_volume`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from learner.core.targets import IGNORE_INDEX, Segment

log = logging.getLogger(__name__)


class PackingError(ValueError):
    pass


class SegmentTooLongError(PackingError):
    pass


class BufferFullError(PackingError):
    pass


@dataclass(frozen=True)
class SegmentInfo:
    offset: int
    length: int
    coord_start: int  # slice of PackedRow.coord_positions belonging to this segment
    coord_end: int
    meta: dict = field(default_factory=dict)


@dataclass
class PackedRow:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    coord_positions: torch.Tensor
    coord_bins: torch.Tensor
    segments: tuple[SegmentInfo, ...]
    fill: float
    # Positions whose label is supervised, known when packing: the loss then needs no
    # `nonzero` on the device (a host sync per row on a GPU).
    ce_positions: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[-1])

    def model_inputs(self) -> dict:
        """Forward kwargs for a transformers causal LM. No attention mask and no cache: that is
        what makes transformers (>= 5) derive the block-causal mask from the restarting
        `position_ids`; with a cache object present it silently attends across segments."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}

    def to(self, device: torch.device | str) -> PackedRow:
        return PackedRow(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.labels.to(device),
            self.coord_positions.to(device),
            self.coord_bins.to(device),
            self.segments,
            self.fill,
            None if self.ce_positions is None else self.ce_positions.to(device),
        )


def pack(segments: Sequence[Segment], packing_length: int | None = None) -> PackedRow:
    """Concatenate segments into one batch-size-1 row with per-segment position ids."""
    if not segments:
        raise PackingError("cannot pack zero segments")
    ids: list[int] = []
    pos: list[int] = []
    labels: list[int] = []
    cpos: list[int] = []
    cbins: list[int] = []
    infos = []
    for seg in segments:
        off = len(ids)
        c0 = len(cpos)
        ids.extend(seg.input_ids)
        labels.extend(seg.labels)
        pos.extend(range(len(seg)))
        cpos.extend(off + p for p in seg.coord_positions)
        cbins.extend(seg.coord_bins)
        infos.append(SegmentInfo(off, len(seg), c0, len(cpos), dict(seg.meta)))
    cap = packing_length or len(ids)
    return PackedRow(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        labels=torch.tensor([labels], dtype=torch.long),
        coord_positions=torch.tensor(cpos, dtype=torch.long),
        coord_bins=torch.tensor(cbins, dtype=torch.long),
        segments=tuple(infos),
        fill=len(ids) / cap,
        ce_positions=torch.tensor([i for i, lab in enumerate(labels) if lab != IGNORE_INDEX], dtype=torch.long),
    )


def select_indices(lengths: Sequence[int], capacity: int) -> list[int]:
    """Indices (ascending) of a subset containing index 0 with the largest total <= capacity."""
    if not lengths:
        return []
    if lengths[0] > capacity:
        raise SegmentTooLongError(f"segment of {lengths[0]} tokens exceeds packing_length {capacity}")
    room = capacity - lengths[0]
    rest = lengths[1:]
    mask = (1 << (room + 1)) - 1
    reach = [1]  # reach[i]: bitset of sums reachable with rest[:i]
    for n in rest:
        reach.append((reach[-1] | (reach[-1] << n)) & mask)
    best = reach[-1].bit_length() - 1
    chosen = []
    s = best
    for i in range(len(rest), 0, -1):  # newest first: drop it whenever older ones reach the sum
        if (reach[i - 1] >> s) & 1:
            continue
        chosen.append(i)
        s -= rest[i - 1]
    return [0] + sorted(chosen)


class Packer:
    def __init__(self, packing_length: int, packing_buffer: int, min_fill: float = 0.0) -> None:
        if packing_length < 1:
            raise ValueError(f"packing_length must be >= 1, got {packing_length}")
        if packing_buffer < 1:
            raise ValueError(f"packing_buffer must be >= 1, got {packing_buffer}")
        if not 0.0 <= min_fill <= 1.0:
            raise ValueError(f"packing_min_fill must be in [0, 1], got {min_fill}")
        self.packing_length = packing_length
        self.packing_buffer = packing_buffer
        self.min_fill = min_fill
        self._buf: list[Segment] = []

    @property
    def pending(self) -> int:
        return len(self._buf)

    @property
    def pending_lengths(self) -> list[int]:
        return [len(s) for s in self._buf]

    @property
    def pending_tokens(self) -> int:
        return sum(len(s) for s in self._buf)

    def carry(self) -> list[Segment]:
        """The segments waiting for a row (what a checkpoint keeps)."""
        return list(self._buf)

    def restore(self, segments: Iterable[Segment]) -> None:
        """Put back the carry buffer of a checkpoint (replaces what is pending)."""
        self._buf = list(segments)

    def add(self, segments: Iterable[Segment]) -> None:
        new = list(segments)
        for s in new:
            if len(s) > self.packing_length:
                raise SegmentTooLongError(
                    f"segment of {len(s)} tokens (prompt {s.prompt_len}) exceeds packing_length "
                    f"{self.packing_length}; raise packing_length or lower max_tokens/max prompt length"
                )
        if len(self._buf) + len(new) > self.packing_buffer:
            raise BufferFullError(
                f"packing buffer would hold {len(self._buf) + len(new)} segments, more than "
                f"packing_buffer={self.packing_buffer}; take rows more often or raise packing_buffer"
            )
        self._buf.extend(new)

    def next_row(self) -> PackedRow | None:
        """Pop the best row (oldest segment always in it); None when the buffer is empty."""
        if not self._buf:
            return None
        idx = select_indices([len(s) for s in self._buf], self.packing_length)
        chosen = [self._buf[i] for i in idx]
        keep = set(idx)
        self._buf = [s for i, s in enumerate(self._buf) if i not in keep]
        row = pack(chosen, self.packing_length)
        if row.fill < self.min_fill:
            log.warning(
                "packed row fill %.3f is below packing_min_fill %.3f (%d segments, %d carried)",
                row.fill,
                self.min_fill,
                len(chosen),
                len(self._buf),
            )
        return row
