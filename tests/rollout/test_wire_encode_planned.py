"""`encode_planned_stream`: the header from names and specs alone, the tensors from a lazy producer
one at a time; the same bytes as `encode_weight_stream`, and no tensor kept once the next one is
asked for (what lets the learner's FULL export hold one LoRA layer at a time)."""

from __future__ import annotations

import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rmsft.weight_wire import FULL, TensorSpec, dtype_name, encode_planned_stream, encode_weight_stream


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(dtype_name(t.dtype), tuple(t.shape))


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 40), max_size=3), max_size=6), frame=st.integers(1, 300), bf16=st.booleans()
)
def test_planned_stream_is_byte_identical(shapes, frame, bf16) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    tensors = [(f"w{i}", torch.randn(shape).to(dtype)) for i, shape in enumerate(shapes)]
    want_header, want = encode_weight_stream(tensors, number=3, mode=FULL, frame_bytes=frame)
    header, got = encode_planned_stream(
        [(n, _spec(t)) for n, t in tensors], iter(tensors), number=3, mode=FULL, frame_bytes=frame
    )
    assert header == want_header
    assert list(got) == list(want)


def test_header_needs_no_tensor_and_the_producer_runs_only_as_frames_are_pulled() -> None:
    made: list[str] = []

    def produce():
        for i in range(3):
            made.append(f"w{i}")
            yield f"w{i}", torch.ones(1000)

    specs = [(f"w{i}", TensorSpec("F32", (1000,))) for i in range(3)]
    header, requests = encode_planned_stream(specs, produce(), number=1, mode=FULL, frame_bytes=1000)
    assert header.tensor_count == 3 and header.total_bytes == 12000 and made == []
    next(requests)  # the header
    next(requests)  # the first piece of w0
    assert made == ["w0"]
    assert len(list(requests)) == 3 * 4 - 1 + 1  # the other pieces + the trailer
    assert made == ["w0", "w1", "w2"]


def test_no_tensor_is_kept_once_the_next_is_requested() -> None:
    refs: list[weakref.ref] = []
    alive_when_asked: list[int] = []

    def produce():
        for i in range(4):
            alive_when_asked.append(sum(r() is not None for r in refs))
            t = torch.randn(300, 100)  # several frames each
            refs.append(weakref.ref(t))
            yield f"w{i}", t
            del t

    specs = [(f"w{i}", TensorSpec("F32", (300, 100))) for i in range(4)]
    _, requests = encode_planned_stream(specs, produce(), number=1, mode=FULL, frame_bytes=16 << 10)
    assert list(requests)
    assert alive_when_asked == [0, 0, 0, 0]  # the previous tensor was gone each time, digest included


@pytest.mark.parametrize(
    ("produced", "match"),
    [
        ([("a", torch.zeros(2)), ("x", torch.zeros(3))], "tensor 1 is 'x' F32\\[3\\], the header announced 'b'"),
        ([("a", torch.zeros(2)), ("b", torch.zeros(3, dtype=torch.bfloat16))], "'b' BF16\\[3\\]"),
        ([("a", torch.zeros(2))], "ended after 1 of 2"),
        ([("a", torch.zeros(2)), ("b", torch.zeros(3)), ("c", torch.zeros(1))], "more tensors than the 2"),
    ],
)
def test_a_producer_that_breaks_its_announcement_stops_the_stream(produced, match) -> None:
    specs = [("a", TensorSpec("F32", (2,))), ("b", TensorSpec("F32", (3,)))]
    _, requests = encode_planned_stream(specs, iter(produced), number=1, mode=FULL)
    with pytest.raises(ValueError, match=match):
        list(requests)


def test_bad_arguments_raise_before_anything_is_produced() -> None:
    with pytest.raises(ValueError, match="duplicate tensor names"):
        encode_planned_stream([("a", TensorSpec("F32", (1,)))] * 2, iter(()), number=1, mode=FULL)
