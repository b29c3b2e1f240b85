"""Post-rollout packer: optimal selection with the oldest segment, no loss, clear errors."""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.core.packing import BufferFullError, MixedVisionError, Packer, SegmentTooLongError, pack, select_indices
from learner.core.targets import IGNORE_INDEX, Segment, SegmentVision, TargetError


def seg(n: int, uid: int) -> Segment:
    ids = tuple(1000 * uid + i for i in range(n))
    labels = (IGNORE_INDEX,) + ids[1:]
    coord = (n - 1,) if n > 1 else ()
    return Segment(ids, labels, coord, tuple(uid % 1000 for _ in coord), 1, 0, {"uid": uid})


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=9), capacity=st.integers(60, 150))
def test_selection_is_optimal_and_keeps_the_oldest(lengths, capacity):
    idx = select_indices(lengths, capacity)
    assert idx[0] == 0 and idx == sorted(set(idx))
    total = sum(lengths[i] for i in idx)
    assert total <= capacity
    best = max(
        lengths[0] + sum(c)
        for k in range(len(lengths))
        for c in itertools.combinations(lengths[1:], k)
        if lengths[0] + sum(c) <= capacity
    )
    assert total == best


def test_ties_prefer_older_segments():
    assert select_indices([5, 3, 3, 3], 8) == [0, 1]
    assert select_indices([5, 1, 2, 3], 8) == [0, 1, 2]  # the older pair beats the newer single


def test_row_layout():
    a, b, c = seg(5, 1), seg(3, 2), seg(4, 3)
    row = pack([a, b, c], packing_length=16)
    assert row.input_ids.shape == (1, 12) and row.position_ids.shape == (1, 12)
    assert row.input_ids[0].tolist() == list(a.input_ids + b.input_ids + c.input_ids)
    assert row.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    assert row.labels[0].tolist() == list(a.labels + b.labels + c.labels)
    assert [(s.offset, s.length) for s in row.segments] == [(0, 5), (5, 3), (8, 4)]
    assert row.coord_positions.tolist() == [4, 7, 11]
    for s, orig in zip(row.segments, (a, b, c), strict=True):
        pos = row.coord_positions[s.coord_start : s.coord_end]
        assert (row.input_ids[0, pos] == torch.tensor([orig.input_ids[p] for p in orig.coord_positions])).all()
        assert s.meta["uid"] == orig.meta["uid"]
    assert row.fill == pytest.approx(12 / 16)


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.integers(1, 40), min_size=0, max_size=6), min_size=1, max_size=12))
def test_stream_emits_every_segment_exactly_once(batches):
    packer = Packer(packing_length=64, packing_buffer=200)
    uid, seen, emitted = 0, [], []
    for lengths in batches:
        new = []
        for n in lengths:
            new.append(seg(n, uid))
            seen.append(uid)
            uid += 1
        packer.add(new)
        oldest = min((s.meta["uid"] for s in packer._buf), default=None)
        if packer.pending_tokens >= 64:
            row = packer.next_row()
            uids = [s.meta["uid"] for s in row.segments]
            assert uids[0] == oldest and row.length <= 64
            emitted += uids
    while (row := packer.next_row()) is not None:
        emitted += [s.meta["uid"] for s in row.segments]
    assert sorted(emitted) == seen and packer.pending == 0


def test_errors_leave_the_buffer_untouched():
    packer = Packer(packing_length=10, packing_buffer=3)
    packer.add([seg(4, 1)])
    with pytest.raises(SegmentTooLongError, match="11 tokens.*packing_length 10"):
        packer.add([seg(3, 2), seg(11, 3)])
    assert packer.pending == 1
    with pytest.raises(BufferFullError, match="4 segments.*packing_buffer=3"):
        packer.add([seg(1, 4), seg(1, 5), seg(1, 6)])
    assert packer.pending == 1
    packer.add([seg(1, 4), seg(1, 5)])
    assert packer.pending == 3
    with pytest.raises(ValueError, match="packing_length"):
        Packer(0, 3)
    with pytest.raises(ValueError, match="packing_min_fill"):
        Packer(10, 3, min_fill=1.5)


def test_warns_below_min_fill(caplog):
    packer = Packer(packing_length=100, packing_buffer=8, min_fill=0.9)
    packer.add([seg(50, 1), seg(45, 2)])
    with caplog.at_level(logging.WARNING, logger="learner.core.packing"):
        assert packer.next_row().fill == pytest.approx(0.95)
        assert not caplog.records
        packer.add([seg(30, 3)])
        packer.next_row()
    assert any("below packing_min_fill" in r.getMessage() for r in caplog.records)


def vseg(n: int, uid: int, grids: list[tuple[int, int, int]]) -> Segment:
    """A segment with fake vision inputs: M-RoPE rows 100*uid + (0, 1, 2) offsets, one pixel row
    per patch whose value is uid (so the concatenation order is visible)."""
    mrope = (100 * uid + torch.arange(n)).expand(3, n) + torch.tensor([[0], [1], [2]])
    if not grids:
        return dataclasses.replace(seg(n, uid), vision=SegmentVision(mrope))
    grid = torch.tensor(grids, dtype=torch.long)
    pixels = torch.full((int(grid.prod(-1).sum()), 6), float(uid))
    return dataclasses.replace(seg(n, uid), vision=SegmentVision(mrope, pixels, grid))


def test_vision_row_layout():
    a, b, c = vseg(5, 1, [(1, 2, 2)]), vseg(3, 2, []), vseg(4, 3, [(1, 2, 4), (1, 4, 2)])
    row = pack([a, b, c], packing_length=16)
    assert row.position_ids.shape == (4, 1, 12) and row.input_ids.shape == (1, 12) and row.length == 12
    assert row.position_ids[0, 0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]  # text row restarts
    for axis in range(3):
        expected = torch.cat([s.vision.mrope_positions[axis] for s in (a, b, c)])
        assert torch.equal(row.position_ids[1 + axis, 0], expected)
    assert row.image_grid_thw.tolist() == [[1, 2, 2], [1, 2, 4], [1, 4, 2]]
    assert row.pixel_values[:, 0].tolist() == [1.0] * 4 + [3.0] * 16  # b has no image: skipped
    # Everything the loss reads is as for a text row.
    text = pack([seg(5, 1), seg(3, 2), seg(4, 3)], packing_length=16)
    for name in ("input_ids", "labels", "coord_positions", "coord_bins", "ce_positions"):
        assert torch.equal(getattr(row, name), getattr(text, name))
    inputs = row.to("cpu").model_inputs()
    assert inputs["pixel_values"] is not None and inputs["image_grid_thw"].shape == (3, 3)
    assert inputs["position_ids"].shape == (4, 1, 12) and inputs["use_cache"] is False


def test_vision_row_without_images_and_text_rows_unchanged():
    row = pack([vseg(3, 1, []), vseg(2, 2, [])])
    assert row.position_ids.shape == (4, 1, 5) and row.pixel_values is None and row.image_grid_thw is None
    assert set(row.model_inputs()) == {"input_ids", "position_ids", "use_cache"}
    text = pack([seg(3, 1), seg(2, 2)])
    assert text.position_ids.shape == (1, 5) and text.pixel_values is None
    assert set(text.to("cpu").model_inputs()) == {"input_ids", "position_ids", "use_cache"}


def test_mixed_vision_is_refused():
    with pytest.raises(MixedVisionError, match="1 of 2 segments carry vision"):
        pack([vseg(3, 1, [(1, 2, 2)]), seg(2, 2)])
    packer = Packer(packing_length=20, packing_buffer=8)
    packer.add([seg(3, 1)])
    with pytest.raises(MixedVisionError, match="cannot share a packer"):
        packer.add([vseg(3, 2, [])])
    assert packer.pending == 1  # nothing added


def test_segment_vision_validation():
    with pytest.raises(TargetError, match="mrope_positions cover 4 tokens but the segment has 5"):
        dataclasses.replace(seg(5, 1), vision=SegmentVision(torch.zeros(3, 4, dtype=torch.long)))
    with pytest.raises(TargetError, match=r"shape \[3, len\]"):
        SegmentVision(torch.zeros(4, 5, dtype=torch.long))
    with pytest.raises(TargetError, match="integer tensor"):
        SegmentVision(torch.zeros(3, 5))
    with pytest.raises(TargetError, match="both or neither"):
        SegmentVision(torch.zeros(3, 5, dtype=torch.long), pixel_values=torch.zeros(4, 6))
    with pytest.raises(TargetError, match=r"\[images, 3\]"):
        SegmentVision(torch.zeros(3, 5, dtype=torch.long), torch.zeros(4, 6), torch.tensor([1, 2, 2]))


def test_vision_segments_survive_a_checkpoint():
    """The packer's carry buffer goes into the checkpoint with torch.save; it must come back equal."""
    packer = Packer(packing_length=20, packing_buffer=8)
    packer.add([vseg(5, 1, [(1, 2, 2)]), vseg(3, 2, [])])
    buf = io.BytesIO()
    torch.save({"packer": packer.carry()}, buf)
    buf.seek(0)
    restored = Packer(packing_length=20, packing_buffer=8)
    restored.restore(torch.load(buf, weights_only=False)["packer"])
    assert restored.carry() == packer.carry()
    a, b = packer.next_row(), restored.next_row()
    assert torch.equal(a.position_ids, b.position_ids) and torch.equal(a.pixel_values, b.pixel_values)
