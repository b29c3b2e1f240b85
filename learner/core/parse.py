"""Token-aligned parsing of a rollout's response token ids.

Public API
- `parse(response_ids, vocab, fmt=COORDEXP) -> ParsedRollout`. Never raises on any id sequence
  (only on a format/vocabulary mismatch: a coord-token format with a vocabulary without them).
- `ParsedRollout.prefix_ids`: the rollout's own ids up to the end of the last complete entry
  (or up to the container's opening bracket when there is none); decoding it and appending the
  closing bracket gives the preamble (below) followed by valid JSON whose entries are exactly
  `objects` (valid) plus `n_dropped` (complete but invalid) ones.
- `ParsedObject.coord_token_indices`: index in `response_ids` of every coord token of the object
  (empty for a format without coord tokens).

How: the response is cut at the first stop id (end-of-turn). A byte-level streaming scanner walks
the format's container: a top-level object (`{`, key, `:`, value, `,`/`}`; coordexp) or a top-level
list (`[`, `{...}`, `,`/`]`; qwen_json), keeping string/escape state and a bracket stack. Each
complete entry is checked with `json.loads` (syntax; failure ends the scan so the prefix stays
valid JSON) and then strictly by the format (bad entries are dropped and counted, never repaired).
A coord token id counts only when it alone fills a JSON string, so the literal text "<|coord_5|>"
spelled with ordinary tokens, or a coord id inside a desc, invalidates the entry; under a format
without coord tokens any coord id inside an entry invalidates it.

Text before the container (`Sure: {"object_1": ...}`, or a ```json fence before a qwen_json `[`),
the preamble, is kept in the prefix as the rollout's own ids (no loss on it: it is the model's own)
and the container that follows is parsed, as CoordExp does. The preamble ends at the first `{` or
`[`: the container's opener opens it, the other bracket ends the scan (so a bare qwen_json object
without its list is not mistaken for the list that its `"bbox_2d": [` opens). A coord token or a
special token before the opener also ends the scan; without an opener nothing of the rollout is
kept and the prefix is the opener alone, written by the parser.

The one place the prefix is not the rollout's own ids: when the token holding the entry's closing
`}` (or the container's opener) also holds text after it (BPE vocabularies fuse `},` or `}}`),
that single token is replaced by the encoding of its part up to the brace; `n_own_prefix_ids` says
how many leading ids are the rollout's own. Coord tokens always precede that point, so their
indices are unaffected.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from learner.core.codec import COORDEXP, DetObject, OutputFormat, container_brackets
from learner.core.vocab import VocabView, require_coord_tokens

_WS = b" \t\r\n"


@dataclass(frozen=True)
class ParsedObject:
    key: str | None  # the entry's key (`object_N`); None for a list container's entries
    index: int
    obj: DetObject
    coord_token_indices: tuple[int, ...]


@dataclass(frozen=True)
class ParsedRollout:
    prefix_ids: tuple[int, ...]
    n_own_prefix_ids: int
    objects: tuple[ParsedObject, ...]
    n_entries: int  # complete entries in the prefix (valid + dropped)
    n_dropped: int
    max_object_index: int  # largest object_N among prefix entries (a list: their count), 0 if none
    closed: bool  # the top-level container was closed
    truncated: bool  # the scan ended before the closing brace (cut, garbage, or end of ids)
    hit_stop: bool  # a stop id (end-of-turn) was found
    response_len: int  # ids before the stop id


class _Entry:
    __slots__ = ("start", "end", "coords", "bare", "tainted")

    def __init__(self, start: int) -> None:
        self.start = start
        self.end = -1
        self.coords: list[tuple[int, int]] = []  # (token index, bin)
        self.bare: list[tuple[int, int, int]] = []  # bare coord tokens (CoordJSON): (byte start, byte end, bin)
        self.tainted = False

    def json_text(self, buf: bytearray) -> str:
        """The entry's text; each bare coord token quoted (`"<|coord_k|>"`), which makes CoordJSON JSON."""
        out, pos = bytearray(), self.start
        for a, b, _ in self.bare:
            out += buf[pos:a] + b'"' + buf[a:b] + b'"'
            pos = b
        out += buf[pos : self.end]
        return bytes(out).decode("utf-8")


class _Scanner:
    """Byte-level state machine over the top-level container; see module docstring."""

    def __init__(self, container: str, bare_coords: bool = False) -> None:
        # The "objects" container is a list inside `{"objects": ` ... `}`: its opener `{` starts the `o_*` states
        # (key, colon, `[`), and its list's `]` waits for the `}` that closes it.
        self.wrapped = container == "objects"
        self.is_list = container in ("list", "objects")
        self.opener = 0x7B if self.wrapped else (0x5B if self.is_list else 0x7B)
        self.closer = 0x5D if self.is_list else 0x7D
        self.bare_coords = bare_coords
        self.outer_key = bytearray()
        self.state = "start"
        self.stack: list[int] = []
        self.in_string = False
        self.escape = False
        self.str_len = 0
        self.pending_coord: tuple[int, int] | None = None
        self.entry: _Entry | None = None
        self.done: list[_Entry] = []
        self.open_end = -1  # byte offset just after the opening bracket
        self.stopped = False
        self.closed = False

    def _stop(self) -> None:
        self.stopped = True

    def coord(self, tok_index: int, k: int, length: int, pos: int = 0) -> None:
        if self.bare_coords:  # CoordJSON: a coord token is an array element of a value, never inside a string
            if (
                self.state == "value"
                and not self.in_string
                and self.stack
                and self.stack[-1] == 0x5D
                and self.entry is not None
            ):
                self.entry.coords.append((tok_index, k))
                self.entry.bare.append((pos, pos + length, k))
                return
            if self.state in ("key", "value") and self.in_string:
                if self.entry is not None:
                    self.entry.tainted = True
                self.str_len += length
                return
            self._stop()
            return
        if self.state == "value" and self.in_string and self.str_len == 0 and self.entry is not None:
            self.pending_coord = (tok_index, k)
            self.str_len += length
            return
        if self.state in ("key", "value") and self.in_string:
            if self.entry is not None:
                self.entry.tainted = True
            self.pending_coord = None
            self.str_len += length
            return
        self._stop()

    def byte(self, c: int, pos: int) -> None:
        st = self.state
        if st == "closed":
            return
        if self.in_string:
            if self.escape:
                self.escape = False
                self.str_len += 1
            elif c == 0x5C:  # backslash
                self.escape = True
                self.str_len += 1
            elif c == 0x22:  # closing quote
                self.in_string = False
                if self.pending_coord is not None and self.entry is not None:
                    self.entry.coords.append(self.pending_coord)
                self.pending_coord = None
                if st == "key":
                    self.state = "colon"
                elif st == "o_key":
                    self.state = "o_colon" if bytes(self.outer_key) == b"objects" else "stopped"
                    if self.state == "stopped":
                        self._stop()
            else:
                if st == "o_key":
                    self.outer_key.append(c)
                self.str_len += 1
            if self.pending_coord is not None and self.in_string:
                if self.entry is not None:
                    self.entry.tainted = True
                self.pending_coord = None
            return
        if st == "start":
            # The preamble: free text up to the first bracket, which must be the container's opener.
            if c == self.opener:
                self.state = "o_open" if self.wrapped else "first"
                if not self.wrapped:
                    self.open_end = pos + 1
            elif c in (0x7B, 0x5B):
                self._stop()
            return
        if c in _WS:
            return
        if st in ("o_open", "o_colon", "o_bracket", "o_close"):  # the "objects" container's own structure
            if st == "o_open" and c == 0x22:
                self.state = "o_key"
                self._open_string()
            elif st == "o_colon" and c == 0x3A:
                self.state = "o_bracket"
            elif st == "o_bracket" and c == 0x5B:
                self.state = "first"
                self.open_end = pos + 1
            elif st == "o_close" and c == 0x7D:
                self.state = "closed"
                self.closed = True
            else:
                self._stop()
            return
        if st in ("first", "next"):  # where an entry may start (`first`: or the container may close)
            if c == self.closer and st == "first":
                self._close()
            elif self.is_list and c == 0x7B:
                self._start_entry(pos)
            elif not self.is_list and c == 0x22:
                self.entry = _Entry(pos)
                self.state = "key"
                self._open_string()
            else:
                self._stop()
        elif st == "colon":
            if c == 0x3A:
                self.state = "value_start"
            else:
                self._stop()
        elif st == "value_start":
            if c == 0x7B:
                self.stack = [0x7D]
                self.state = "value"
            else:
                self._stop()
        elif st == "value":
            if c == 0x22:
                self._open_string()
            elif c in (0x7B, 0x5B):
                self.stack.append(c + 2)  # '{'->'}', '['->']'
            elif c in (0x7D, 0x5D):
                if c != self.stack[-1]:
                    self._stop()
                    return
                self.stack.pop()
                if not self.stack:
                    assert self.entry is not None
                    self.entry.end = pos + 1
                    self.done.append(self.entry)
                    self.entry = None
                    self.state = "after_value"
        elif st == "after_value":
            if c == 0x2C:
                self.state = "next"
            elif c == self.closer:
                self._close()
            else:
                self._stop()

    def _close(self) -> None:
        """The container's closer: closed, or for the "objects" container the list closed, its `}` to come."""
        if self.wrapped:
            self.state = "o_close"
        else:
            self.state = "closed"
            self.closed = True

    def _start_entry(self, pos: int) -> None:
        """A list entry: the object itself is the value."""
        self.entry = _Entry(pos)
        self.stack = [0x7D]
        self.state = "value"

    def _open_string(self) -> None:
        self.in_string = True
        self.escape = False
        self.str_len = 0
        self.pending_coord = None


def parse(response_ids: Sequence[int], vocab: VocabView, fmt: OutputFormat = COORDEXP) -> ParsedRollout:
    """Parse one response; see the module docstring. Never raises on any id sequence."""
    require_coord_tokens(vocab, fmt)
    ids: list[int] = []
    hit_stop = False
    for t in response_ids:
        t = int(t)
        if t in vocab.stop_ids:
            hit_stop = True
            break
        ids.append(t)

    scanner = _Scanner(fmt.container, getattr(fmt, "bare_coords", False))
    offsets: list[int] = []  # byte offset where each scanned token starts
    buf = bytearray()
    n_vocab = vocab.vocab_size
    for ti, t in enumerate(ids):
        if scanner.stopped or scanner.closed:
            break
        offsets.append(len(buf))
        if t < 0 or t >= n_vocab or t in vocab.special_ids:
            scanner.stopped = True
            break
        data = vocab.token_bytes[t]
        k = vocab.coord_bin_of.get(t)
        if k is not None:
            scanner.coord(ti, k, len(data), len(buf))
            buf += data
            continue
        for c in data:
            scanner.byte(c, len(buf))
            buf.append(c)
            if scanner.stopped:
                break
    offsets.append(len(buf))  # sentinel: end of the last scanned token

    objects: list[ParsedObject] = []
    seen_keys: set[str] = set()
    n_entries = n_dropped = max_index = 0
    prefix_end = scanner.open_end
    for entry in scanner.done:
        key: str | None = None
        try:
            text = entry.json_text(buf)
            if scanner.is_list:
                value = json.loads(text, object_pairs_hook=list)
            else:
                pairs = json.loads("{" + text + "}", object_pairs_hook=list)
                key, value = pairs[0]
        except ValueError:
            break  # not valid JSON: the prefix must end before this entry
        n_entries += 1
        prefix_end = entry.end
        # A list's entries are numbered by position; an object's by their `object_N` key.
        index = n_entries if key is None else fmt.object_index(key)
        if index is not None:
            max_index = max(max_index, index)
        obj = None
        if (key is None or key not in seen_keys) and not entry.tainted and _no_duplicate_keys(value):
            obj = fmt.validate_entry(key, _to_dict(value))
        if key is not None:
            seen_keys.add(key)
        want_coords = len(obj.bins) if obj is not None and fmt.coord_tokens else 0
        if obj is None or len(entry.coords) != want_coords:
            n_dropped += 1
            continue
        objects.append(ParsedObject(key, index or 0, obj, tuple(i for i, _ in entry.coords)))

    opener = container_brackets(fmt.container)[0]
    prefix_ids, n_own = _prefix_ids(ids, offsets, buf, prefix_end, vocab, opener)
    return ParsedRollout(
        prefix_ids=tuple(prefix_ids),
        n_own_prefix_ids=n_own,
        objects=tuple(objects),
        n_entries=n_entries,
        n_dropped=n_dropped,
        max_object_index=max_index,
        closed=scanner.closed and n_entries == len(scanner.done),
        truncated=not scanner.closed or n_entries != len(scanner.done),
        hit_stop=hit_stop,
        response_len=len(ids),
    )


def _no_duplicate_keys(value: object) -> bool:
    if isinstance(value, list) and all(isinstance(p, tuple) for p in value):
        keys = [k for k, _ in value]
        return len(keys) == len(set(keys))
    return True


def _to_dict(value: object) -> object:
    if isinstance(value, list) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return dict(value)
    return value


def _prefix_ids(
    ids: list[int], offsets: list[int], buf: bytearray, end: int, vocab: VocabView, opener: str
) -> tuple[list[int], int]:
    """Own ids covering bytes [0, end); re-encode only a token that straddles `end`."""
    if end <= 0:
        return list(vocab.encode(opener)), 0
    # token t covers bytes [offsets[t], offsets[t+1]); find the one holding byte end-1
    lo, hi = 0, len(offsets) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= end - 1:
            lo = mid
        else:
            hi = mid - 1
    t = lo
    if offsets[t + 1] == end:
        return ids[: t + 1], t + 1
    # Start the re-encoded piece on a character boundary (a byte-level token may begin mid-character).
    while t > 0 and 0x80 <= buf[offsets[t]] < 0xC0:
        t -= 1
    fragment = bytes(buf[offsets[t] : end]).decode("utf-8", errors="replace")
    return ids[:t] + list(vocab.encode(fragment)), t
