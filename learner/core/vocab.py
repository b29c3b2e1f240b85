"""`VocabView`: the few tokenizer facts the core algorithm needs, built once at the edge.

Core code never holds a tokenizer: it takes a `VocabView` (coord token ids, the bytes of every
token, an `encode` callable, end-of-turn and stop ids). `VocabView.from_hf_tokenizer(tok,
coord_tokens=True)` builds one from a Hugging Face tokenizer; tests and other formats can build one by
hand.

Coord tokens: a format that writes coordinates as `<|coord_k|>` tokens (coordexp) needs all 1000 of
them; one that writes plain-text numbers (qwen_json) needs none, so a stock Qwen-VL tokenizer works.
`coord_token_ids` is therefore either exactly 1000 ids or empty (`from_hf_tokenizer(tok,
coord_tokens=False)` does not look them up: any such tokens in the vocabulary are then plain text to
the parser). `require_coord_tokens(vocab, fmt)` is the check that the two agree; the parser and the
target builder run it.

Token bytes matter because the parser scans bytes, not decoded strings: a byte-level BPE token can
hold half of a UTF-8 character, and `decode([id])` would turn it into U+FFFD.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from learner.core.codec import NUM_BINS, OutputFormat, coord_token_text

MISSING_COORD_TOKENS = (
    "the coordexp output format writes coordinates as the {n} tokens <|coord_0|>..<|coord_999|>, which this "
    "tokenizer lacks{detail}: run `rmsft prepare-model` to add them to the model, or use `training.format: qwen_json` "
    "(plain-text coordinates, the stock Qwen-VL answer format)"
)


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-unicode table used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


@dataclass(frozen=True)
class VocabView:
    """Tokenizer facts used by parse/targets/losses.

    coord_token_ids[k] is the id of `<|coord_k|>` (empty for a format without coord tokens);
    token_bytes[id] is the UTF-8 bytes that id stands for; `encode(text)` returns ids without special
    tokens added; `eos_id` is appended as the end-of-turn of Y_train; `stop_ids` cut a response;
    `special_ids` (other control tokens) end the scan as garbage.
    """

    coord_token_ids: tuple[int, ...]
    token_bytes: tuple[bytes, ...]
    encode: Callable[[str], list[int]]
    eos_id: int
    stop_ids: frozenset[int] = frozenset()
    special_ids: frozenset[int] = frozenset()
    coord_bin_of: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "coord_token_ids", tuple(int(t) for t in self.coord_token_ids))
        if len(self.coord_token_ids) not in (0, NUM_BINS):
            raise ValueError(f"VocabView needs {NUM_BINS} coord token ids or none, got {len(self.coord_token_ids)}")
        if len(set(self.coord_token_ids)) != len(self.coord_token_ids):
            raise ValueError("VocabView coord token ids are not distinct")
        object.__setattr__(self, "coord_bin_of", {t: k for k, t in enumerate(self.coord_token_ids)})
        object.__setattr__(self, "stop_ids", frozenset(self.stop_ids) | {self.eos_id})

    @property
    def has_coord_tokens(self) -> bool:
        return bool(self.coord_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes[i] for i in ids)

    @classmethod
    def from_hf_tokenizer(cls, tok: Any, coord_tokens: bool = True) -> VocabView:
        """Build from a transformers tokenizer. `coord_tokens`: the output format needs the `<|coord_k|>`
        tokens (k = 0..999), and a tokenizer without them is an error saying how to get them; False
        (a plain-text format) leaves `coord_token_ids` empty."""
        vocab_size = len(tok)
        unk = getattr(tok, "unk_token_id", None)
        coord_ids = []
        for k in range(NUM_BINS if coord_tokens else 0):
            tid = tok.convert_tokens_to_ids(coord_token_text(k))
            if tid is None or tid == unk:
                raise ValueError(MISSING_COORD_TOKENS.format(n=NUM_BINS, detail=f" (no {coord_token_text(k)!r})"))
            coord_ids.append(int(tid))
        added = {int(i): str(t) for i, t in tok.added_tokens_decoder.items()}
        special = {int(i) for i, t in tok.added_tokens_decoder.items() if getattr(t, "special", False)}
        byte_dec = _byte_level_decoder()
        pieces = tok.convert_ids_to_tokens(list(range(vocab_size)))
        token_bytes: list[bytes] = []
        for i, piece in enumerate(pieces):
            if i in added:
                token_bytes.append(added[i].encode("utf-8"))
            elif piece is not None and all(ch in byte_dec for ch in piece):
                token_bytes.append(bytes(byte_dec[ch] for ch in piece))
            else:  # not a byte-level vocabulary: fall back to decoding the single token
                token_bytes.append(tok.decode([i]).encode("utf-8"))
        eos = tok.eos_token_id
        if eos is None:
            raise ValueError("tokenizer has no eos_token_id; the end-of-turn token is needed for Y_train")

        def encode(text: str) -> list[int]:
            return list(tok.encode(text, add_special_tokens=False))

        return cls(
            coord_token_ids=tuple(coord_ids),
            token_bytes=tuple(token_bytes),
            encode=encode,
            eos_id=int(eos),
            stop_ids=frozenset({int(eos)}),
            special_ids=frozenset(special - set(coord_ids)),
        )


def require_coord_tokens(vocab: VocabView, fmt: OutputFormat) -> None:
    """Raise ValueError when `fmt` writes coord tokens and `vocab` has none (a configuration mismatch)."""
    if fmt.coord_tokens and not vocab.coord_token_ids:
        raise ValueError(MISSING_COORD_TOKENS.format(n=NUM_BINS, detail=" (the VocabView has no coord token ids)"))
