"""Post-rollout packing: a carry buffer of segments, one padding-free row per call.

Public API
- `Packer(packing_length, packing_buffer, min_fill=0.0)`; `.add(segments)` (all or nothing);
  `.next_row() -> PackedRow | None`; `.pending`, `.pending_tokens`, `.pending_lengths`.
- `pack(segments) -> PackedRow`: concatenate given segments (also used for one-segment rows).
- `PackedRow`: tensors `input_ids`, `position_ids`, `labels` (shape [1, L]), `coord_positions`,
  `coord_bins` ([n], positions already shifted by each segment's offset), `segments`
  (`SegmentInfo(offset, length, coord_start, coord_end, meta)`), `fill`. `.to(device)`;
  `model(**row.model_inputs())` runs it (no attention mask, `use_cache=False`: both required).
  Vision-language rows (every segment carries `Segment.vision`): `position_ids` has shape
  [4, 1, L] (row 0 the text positions restarting per segment, rows 1-3 the segments' M-RoPE
  positions concatenated), and `pixel_values` / `image_grid_thw` hold the row's images in segment
  order (None when no segment has one); `model_inputs()` passes them on.
- Errors: `SegmentTooLongError` (a segment longer than packing_length), `BufferFullError`
  (adding would hold more than packing_buffer segments); nothing is added when either is raised.
  `MixedVisionError`: segments with and without `vision` in one `pack` call or one packer.

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


class MixedVisionError(PackingError):
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
    # Vision-language rows with images: the images of all segments, in segment order.
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    # The second-generation recipe's extras (Segment has their meaning); None / empty when no segment has them.
    ce_weights: torch.Tensor | None = None  # [L] float
    coord_weights: torch.Tensor | None = None  # [n] float, aligned with coord_positions
    ul_positions: torch.Tensor | None = None  # [u]
    ul_tokens: torch.Tensor | None = None  # [u]
    box_coords: torch.Tensor | None = None  # [b, 4]: indices into coord_positions
    box_bins: torch.Tensor | None = None  # [b, 4]
    box_weights: torch.Tensor | None = None  # [b] float

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[-1])

    def model_inputs(self) -> dict:
        """Forward kwargs for a transformers causal LM. No attention mask and no cache: that is
        what makes transformers (>= 5) derive the block-causal mask from the restarting
        `position_ids`; with a cache object present it silently attends across segments.
        Qwen-VL models take the [4, 1, L] ids: row 0 (the restarts) builds the mask, rows 1-3 the
        rotary embedding; given position ids they skip computing their own M-RoPE positions."""
        out = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        if self.pixel_values is not None:
            out["pixel_values"] = self.pixel_values
            out["image_grid_thw"] = self.image_grid_thw
        return out

    def to(self, device: torch.device | str) -> PackedRow:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PackedRow(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.labels.to(device),
            self.coord_positions.to(device),
            self.coord_bins.to(device),
            self.segments,
            self.fill,
            move(self.ce_positions),
            move(self.pixel_values),
            move(self.image_grid_thw),
            move(self.ce_weights),
            move(self.coord_weights),
            move(self.ul_positions),
            move(self.ul_tokens),
            move(self.box_coords),
            move(self.box_bins),
            move(self.box_weights),
        )

    @property
    def n_unlikelihood(self) -> int:
        return 0 if self.ul_positions is None else int(self.ul_positions.numel())

    @property
    def n_boxes(self) -> int:
        return 0 if self.box_coords is None else int(self.box_coords.shape[0])


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
    ce_w: list[float] = []
    coord_w: list[float] = []
    ul_pos: list[int] = []
    ul_tok: list[int] = []
    box_coords: list[list[int]] = []
    box_bins: list[tuple[int, ...]] = []
    box_w: list[float] = []
    for seg in segments:
        off = len(ids)
        c0 = len(cpos)
        ids.extend(seg.input_ids)
        labels.extend(seg.labels)
        pos.extend(range(len(seg)))
        cpos.extend(off + p for p in seg.coord_positions)
        cbins.extend(seg.coord_bins)
        infos.append(SegmentInfo(off, len(seg), c0, len(cpos), dict(seg.meta)))
        ce_w.extend(
            seg.ce_weights
            if seg.ce_weights is not None
            else (0.0 if lab == IGNORE_INDEX else 1.0 for lab in seg.labels)
        )
        coord_w.extend(seg.coord_weights if seg.coord_weights is not None else [1.0] * len(seg.coord_positions))
        ul_pos.extend(off + p for p in seg.ul_positions)
        ul_tok.extend(seg.ul_tokens)
        where = {p: c0 + i for i, p in enumerate(seg.coord_positions)}
        box_coords.extend([where[p] for p in group] for group in seg.box_positions)
        box_bins.extend(seg.box_bins)
        box_w.extend(seg.box_weights)
    weighted = any(s.ce_weights is not None or s.coord_weights is not None for s in segments)
    cap = packing_length or len(ids)
    text_pos = torch.tensor([pos], dtype=torch.long)
    position_ids, pixel_values, image_grid_thw = _vision_inputs(segments, text_pos)
    return PackedRow(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=position_ids,
        labels=torch.tensor([labels], dtype=torch.long),
        coord_positions=torch.tensor(cpos, dtype=torch.long),
        coord_bins=torch.tensor(cbins, dtype=torch.long),
        segments=tuple(infos),
        fill=len(ids) / cap,
        ce_positions=torch.tensor([i for i, lab in enumerate(labels) if lab != IGNORE_INDEX], dtype=torch.long),
        pixel_values=pixel_values,
        image_grid_thw=image_grid_thw,
        ce_weights=torch.tensor(ce_w, dtype=torch.float32) if weighted else None,
        coord_weights=torch.tensor(coord_w, dtype=torch.float32) if weighted else None,
        ul_positions=torch.tensor(ul_pos, dtype=torch.long) if ul_pos else None,
        ul_tokens=torch.tensor(ul_tok, dtype=torch.long) if ul_pos else None,
        box_coords=torch.tensor(box_coords, dtype=torch.long).reshape(-1, 4) if box_coords else None,
        box_bins=torch.tensor(box_bins, dtype=torch.long).reshape(-1, 4) if box_coords else None,
        box_weights=torch.tensor(box_w, dtype=torch.float32) if box_coords else None,
    )


def _vision_inputs(
    segments: Sequence[Segment], text_pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(position_ids, pixel_values, image_grid_thw) of a row: [1, L] ids and no images for text
    segments; [4, 1, L] ids and the images in segment order when the segments carry vision."""
    with_vision = sum(s.vision is not None for s in segments)
    if with_vision == 0:
        return text_pos, None, None
    if with_vision != len(segments):
        # A text segment's missing M-RoPE rows cannot be guessed here without knowing the model;
        # filling them wrongly would train on wrong positions without any error.
        raise MixedVisionError(
            f"{with_vision} of {len(segments)} segments carry vision inputs (M-RoPE positions): in a "
            "vision-language row every segment needs them, text-only ones too (learner.data.vision computes them)"
        )
    visions = [s.vision for s in segments if s.vision is not None]  # every one (checked above)
    mrope = torch.cat([v.mrope_positions.to(torch.long) for v in visions], dim=1)
    # Row 0 (restarting per segment) is what transformers derives the block-causal mask from; rows
    # 1-3 are the rotary positions. Without row 0 the mask would be causal over the whole row.
    position_ids = torch.cat([text_pos, mrope], dim=0)[:, None, :]
    with_images = [v for v in visions if v.pixel_values is not None]
    if not with_images:
        return position_ids, None, None
    # (SegmentVision gives pixel_values and image_grid_thw together)
    pixel_values = torch.cat([pv for v in with_images if (pv := v.pixel_values) is not None], dim=0)
    image_grid_thw = torch.cat([g for v in with_images if (g := v.image_grid_thw) is not None], dim=0)
    return position_ids, pixel_values, image_grid_thw


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
        if len({s.vision is not None for s in [*self._buf, *new]}) > 1:
            # Refused here, not when a row is packed, so the buffer never holds a row it cannot pack.
            raise MixedVisionError(
                "segments with and without vision inputs cannot share a packer: a vision-language "
                "model's segments all need M-RoPE positions (learner.data.vision computes them)"
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
