"""Shared strategies and a hand-made vocabulary with fused tokens for the learner.core tests."""

from __future__ import annotations

import json
import re

from hypothesis import strategies as st

from learner.core.codec import COORDEXP, NUM_BINS, DetObject, OutputFormat, container_brackets, coord_token_text
from learner.core.vocab import VocabView

# Multi-character pieces that real BPE vocabularies fuse across the cut point of the kept prefix
# (the last ones are qwen_json's: list brackets fused with braces and digits).
FUSED = [
    "}}",
    "},",
    '"]}',
    '"]}}',
    '"]},',
    '{"',
    '}, "',
    'é"}',
    '"}}',
    '"}',
    "}}\n",
    "} ",
    '"]]}',
    "]]},",
    "}]",
    "},{",
    "}, {",
    '[{"',
    '"}]',
    '"},',
    "0]",
    '], "',
    ": [",
    ' {"',
]


def fused_vocab(coord_tokens: bool = True) -> VocabView:
    """Bytes 0..255, fused structural pieces, 1000 coord tokens (unless `coord_tokens` is False), eos and
    one control token."""
    pieces: list[bytes] = [bytes([b]) for b in range(256)] + [f.encode() for f in FUSED]
    coord_ids = list(range(len(pieces), len(pieces) + NUM_BINS)) if coord_tokens else []
    pieces += [coord_token_text(k).encode() for k in range(len(coord_ids))]
    eos = len(pieces)
    pieces.append(b"<|im_end|>")
    ctrl = len(pieces)
    pieces.append(b"<|im_start|>")
    multi = sorted(((p, i) for i, p in enumerate(pieces[256 : 256 + len(FUSED)], 256)), key=lambda x: -len(x[0]))
    coord_re = re.compile(rb"<\|coord_(\d{1,3})\|>")

    def encode(text: str) -> list[int]:
        data, out, i = text.encode(), [], 0
        while i < len(data):
            m = coord_re.match(data, i) if coord_ids else None
            if m and int(m.group(1)) < NUM_BINS and str(int(m.group(1))) == m.group(1).decode():
                out.append(coord_ids[int(m.group(1))])
                i = m.end()
                continue
            for p, tid in multi:
                if data.startswith(p, i):
                    out.append(tid)
                    i += len(p)
                    break
            else:
                out.append(data[i])
                i += 1
        return out

    return VocabView(
        coord_token_ids=tuple(coord_ids),
        token_bytes=tuple(pieces),
        encode=encode,
        eos_id=eos,
        special_ids=frozenset({ctrl}),
    )


_desc_chars = st.sampled_from(list('abcxyz ABC0123"\\/{}[]:,é漢\n\t') + ["🙂"])
descs = st.text(_desc_chars, min_size=1, max_size=12).filter(lambda s: s.strip() != "")
bins = st.integers(0, NUM_BINS - 1)


@st.composite
def boxes(draw, desc=descs) -> DetObject:
    x = sorted(draw(st.lists(bins, min_size=2, max_size=2)))
    y = sorted(draw(st.lists(bins, min_size=2, max_size=2)))
    return DetObject(draw(desc), "bbox_2d", (x[0], y[0], x[1], y[1]))


@st.composite
def det_objects(draw) -> DetObject:
    if draw(st.booleans()):
        return draw(boxes())
    n = draw(st.integers(3, 6))
    return DetObject(draw(descs), "poly", tuple(draw(st.lists(bins, min_size=2 * n, max_size=2 * n))))


object_lists = st.lists(det_objects(), min_size=0, max_size=5)
box_lists = st.lists(boxes(), min_size=0, max_size=5)


def split_preamble(data: bytes) -> tuple[bytes, str]:
    """(preamble, JSON text) of a kept prefix's bytes: the preamble never holds a bracket (the parser's
    rule) and, being whatever the rollout wrote, need not be valid UTF-8; the JSON must be."""
    cut = min((i for i in (data.find(b"{"), data.find(b"[")) if i >= 0), default=len(data))
    return data[:cut], data[cut:].decode("utf-8")


def entry_pairs(vocab: VocabView, prefix_ids, fmt: OutputFormat = COORDEXP) -> list[tuple[str | None, object]]:
    """Decode a kept prefix, drop its preamble, close it, and return its top-level (key, value) pairs
    ((None, value) for a list container); raises if it is not valid JSON."""
    _, body = split_preamble(vocab.decode_bytes(prefix_ids))
    data = json.loads(body + container_brackets(fmt.container)[1], object_pairs_hook=lambda pairs: pairs)
    return [(None, v) for v in data] if fmt.container == "list" else data


def pairs_to_value(value):
    if isinstance(value, list) and all(isinstance(p, tuple) for p in value):
        return {k: pairs_to_value(v) for k, v in value}
    return value


def render(objects, fmt: OutputFormat = COORDEXP) -> str:
    return fmt.render(objects)
