"""Shared strategies and a hand-made vocabulary with fused tokens for the learner.core tests."""

from __future__ import annotations

import json
import re

from hypothesis import strategies as st

from learner.core.codec import COORDEXP, NUM_BINS, DetObject, coord_token_text
from learner.core.vocab import VocabView

# Multi-character pieces that real BPE vocabularies fuse across the cut point of the kept prefix.
FUSED = ["}}", "},", '"]}', '"]}}', '"]},', '{"', '}, "', 'é"}', '"}}', '"}', "}}\n", "} "]


def fused_vocab() -> VocabView:
    """Bytes 0..255, fused structural pieces, 1000 coord tokens, eos and one control token."""
    pieces: list[bytes] = [bytes([b]) for b in range(256)] + [f.encode() for f in FUSED]
    coord_ids = list(range(len(pieces), len(pieces) + NUM_BINS))
    pieces += [coord_token_text(k).encode() for k in range(NUM_BINS)]
    eos = len(pieces)
    pieces.append(b"<|im_end|>")
    ctrl = len(pieces)
    pieces.append(b"<|im_start|>")
    multi = sorted(((p, i) for i, p in enumerate(pieces[256 : 256 + len(FUSED)], 256)), key=lambda x: -len(x[0]))
    coord_re = re.compile(rb"<\|coord_(\d{1,3})\|>")

    def encode(text: str) -> list[int]:
        data, out, i = text.encode(), [], 0
        while i < len(data):
            m = coord_re.match(data, i)
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
def det_objects(draw) -> DetObject:
    desc = draw(descs)
    if draw(st.booleans()):
        return DetObject(desc, "bbox_2d", tuple(draw(st.lists(bins, min_size=4, max_size=4))))
    n = draw(st.integers(3, 6))
    return DetObject(desc, "poly", tuple(draw(st.lists(bins, min_size=2 * n, max_size=2 * n))))


object_lists = st.lists(det_objects(), min_size=0, max_size=5)


def entry_pairs(vocab: VocabView, prefix_ids) -> list[tuple[str, object]]:
    """Decode a kept prefix, close it, and return its top-level (key, value) pairs (raises if invalid)."""
    text = vocab.decode_bytes(prefix_ids).decode("utf-8") + "}"
    return json.loads(text, object_pairs_hook=lambda pairs: pairs)


def pairs_to_value(value):
    if isinstance(value, list) and all(isinstance(p, tuple) for p in value):
        return {k: pairs_to_value(v) for k, v in value}
    return value


def render(objects) -> str:
    return COORDEXP.render(objects)
