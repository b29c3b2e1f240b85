"""Parser properties: never raises, the kept prefix is valid JSON with exactly the kept entries,
coord token indices point at the right ids, and serialize -> tokenize -> parse round-trips."""

from __future__ import annotations

import json

import pytest
from core_helpers import entry_pairs, object_lists, pairs_to_value, render
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from learner.core.codec import COORDEXP, DetObject
from learner.core.parse import ParsedRollout, parse
from learner.core.vocab import VocabView

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def check_invariants(ids: list[int], parsed: ParsedRollout, vocab: VocabView) -> list[tuple[str, object]]:
    n_own = parsed.n_own_prefix_ids
    assert list(parsed.prefix_ids[:n_own]) == list(ids[:n_own]), "own prefix ids must be the rollout's"
    assert len(parsed.prefix_ids) - n_own <= 8, "only the straddling token may be re-encoded"
    pairs = entry_pairs(vocab, parsed.prefix_ids)  # raises if not valid JSON
    assert len(pairs) == parsed.n_entries == len(parsed.objects) + parsed.n_dropped
    keys = [k for k, _ in pairs]
    pos = 0
    for o in parsed.objects:
        pos = keys.index(o.key, pos)  # kept objects are entries, in order
        assert COORDEXP.validate_entry(o.key, pairs_to_value(pairs[pos][1])) == o.obj
        pos += 1
        assert len(o.coord_token_indices) == len(o.obj.bins)
        for idx, b in zip(o.coord_token_indices, o.obj.bins, strict=True):
            assert idx < n_own
            assert vocab.coord_bin_of[ids[idx]] == b
    assert parsed.max_object_index >= max((o.index for o in parsed.objects), default=0)
    return pairs


def encode_answer(vocab: VocabView, objects) -> list[int]:
    return list(vocab.encode(render(objects))) + [vocab.eos_id]


@pytest.mark.parametrize("vocab_name", ["tiny_vocab", "fused"])
@SETTINGS
@given(objects=object_lists)
def test_round_trip(request, vocab_name, objects):
    vocab = request.getfixturevalue(vocab_name)
    ids = encode_answer(vocab, objects) + list(vocab.encode("trailing text after eos"))
    parsed = parse(ids, vocab)
    assert [o.obj for o in parsed.objects] == objects
    assert [o.key for o in parsed.objects] == [f"object_{i + 1}" for i in range(len(objects))]
    assert parsed.closed and not parsed.truncated and parsed.hit_stop and parsed.n_dropped == 0
    check_invariants(ids, parsed, vocab)


@pytest.mark.parametrize("vocab_name", ["tiny_vocab", "fused"])
@SETTINGS
@given(objects=object_lists, data=st.data())
def test_truncated(request, vocab_name, objects, data):
    vocab = request.getfixturevalue(vocab_name)
    ids = encode_answer(vocab, objects)
    cut = data.draw(st.integers(0, len(ids)))
    parsed = parse(ids[:cut], vocab)
    check_invariants(ids, parsed, vocab)
    kept = [o.obj for o in parsed.objects]
    assert kept == objects[: len(kept)] and parsed.n_dropped == 0
    # Every object whose tokens are all inside the cut (and followed by its closing brace) is kept.
    full_prefix = vocab.decode_bytes(ids[:cut])
    complete = sum(1 for i in range(len(objects)) if full_prefix.startswith(render(objects[: i + 1])[:-1].encode()))
    assert len(kept) == complete


@st.composite
def corrupted(draw, vocab: VocabView):
    objects = draw(object_lists)
    ids = list(vocab.encode(render(objects)))
    hot = [vocab.eos_id, *vocab.special_ids, vocab.coord_token_ids[0], vocab.coord_token_ids[999], -1,
           vocab.vocab_size, *vocab.encode('"}],{: \\')]  # fmt: skip
    any_id = st.one_of(st.integers(-3, vocab.vocab_size + 3), st.sampled_from(hot))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["sub", "ins", "del", "cut"]))
        i = draw(st.integers(0, len(ids)))
        if op == "sub" and i < len(ids):
            ids[i] = draw(any_id)
        elif op == "ins":
            ids.insert(i, draw(any_id))
        elif op == "del" and i < len(ids):
            del ids[i]
        elif op == "cut":
            ids = ids[:i]
    return ids


@pytest.mark.parametrize(("vocab_name", "n"), [("tiny_vocab", 700), ("fused", 400)])
def test_corrupted_never_raises(request, vocab_name, n):
    vocab = request.getfixturevalue(vocab_name)

    @settings(max_examples=n, deadline=None)
    @given(ids=corrupted(vocab))
    def run(ids):
        parsed = parse(ids, vocab)
        check_invariants(ids, parsed, vocab)

    run()


@SETTINGS
@given(ids=st.lists(st.integers(-10, 3300), max_size=120))
def test_garbage_never_raises(tiny_vocab, ids):
    parsed = parse(ids, tiny_vocab)
    check_invariants(ids, parsed, tiny_vocab)


def _manual(vocab: VocabView, text: str) -> list[int]:
    return list(vocab.encode(text)) + [vocab.eos_id]


def _box(k: int) -> str:
    return ", ".join(f'"<|coord_{k + i}|>"' for i in range(4))


def test_invalid_entries_are_dropped_not_repaired(tiny_vocab):
    text = (
        '{"object_1": {"desc": "", "bbox_2d": [' + _box(1) + "]}, "
        '"object_2": {"desc": "cat", "bbox_2d": [' + _box(2) + "]}, "
        '"object_2": {"desc": "dup", "bbox_2d": [' + _box(3) + "]}, "
        '"obj_4": {"desc": "dog", "bbox_2d": [' + _box(4) + "]}, "
        '"object_5": {"desc": "dog", "bbox_2d": [' + _box(5) + '], "extra": 1}, '
        '"object_6": {"desc": "dog", "poly": [' + _box(6) + "]}, "
        '"object_9": {"desc": "bird", "bbox_2d": [' + _box(9) + "]}}"
    )
    ids = _manual(tiny_vocab, text)
    parsed = parse(ids, tiny_vocab)
    check_invariants(ids, parsed, tiny_vocab)
    assert [o.key for o in parsed.objects] == ["object_2", "object_9"]
    assert parsed.n_dropped == 5 and parsed.max_object_index == 9 and parsed.closed


def test_coord_text_must_be_coord_tokens(tiny_vocab):
    good = '{"object_1": {"desc": "cat", "bbox_2d": [' + _box(1) + "]}"
    ids = list(tiny_vocab.encode(good))
    # Respell the first coord token with ordinary byte-level pieces: same text, not a coord id.
    first = next(i for i, t in enumerate(ids) if t in tiny_vocab.coord_bin_of)
    spelled = [t for ch in "<|coord_1|>" for t in tiny_vocab.encode(ch)]
    assert not set(spelled) & set(tiny_vocab.coord_token_ids)
    bad = ids[:first] + spelled + ids[first + 1 :] + [tiny_vocab.eos_id]
    parsed = parse(bad, tiny_vocab)
    check_invariants(bad, parsed, tiny_vocab)
    assert parsed.objects == () and parsed.n_dropped == 1
    # A coord id inside a desc string invalidates the object as well.
    in_desc = tiny_vocab.encode('{"object_1": {"desc": "a') + [tiny_vocab.coord_token_ids[5]]
    in_desc += tiny_vocab.encode('", "bbox_2d": [' + _box(1) + "]}}") + [tiny_vocab.eos_id]
    parsed = parse(in_desc, tiny_vocab)
    check_invariants(in_desc, parsed, tiny_vocab)
    assert parsed.objects == () and parsed.n_dropped == 1


def test_fused_closing_token_is_split(fused):
    obj = DetObject("cat", "bbox_2d", (1, 2, 3, 4))
    ids = fused.encode(render([obj])[:-1] + ', "object_2": {"de')
    assert b'"]},' in [fused.token_bytes[t] for t in ids]  # the object's brace shares a token
    parsed = parse(ids, fused)
    check_invariants(ids, parsed, fused)
    assert [o.obj for o in parsed.objects] == [obj]
    assert parsed.n_own_prefix_ids < len(parsed.prefix_ids)
    assert json.loads(fused.decode_bytes(parsed.prefix_ids).decode() + "}") == json.loads(render([obj]))


def test_garbage_before_brace_and_stop_cut(tiny_vocab):
    parsed = parse(tiny_vocab.encode('Sure! {"object_1": {}}'), tiny_vocab)
    assert parsed.objects == () and parsed.truncated and parsed.n_own_prefix_ids == 0
    assert tiny_vocab.decode_bytes(parsed.prefix_ids) == b"{"
    obj = DetObject("cat", "bbox_2d", (1, 2, 3, 4))
    ids = tiny_vocab.encode(render([obj])[:-1]) + [tiny_vocab.eos_id] + tiny_vocab.encode("}")
    parsed = parse(ids, tiny_vocab)
    assert [o.obj for o in parsed.objects] == [obj] and parsed.truncated and parsed.hit_stop


@SETTINGS
@given(text=st.text(max_size=40))
def test_vocab_view_token_bytes_match_the_tokenizer(tiny_vocab, tiny_tokenizer, text):
    ids = tiny_vocab.encode(text)
    assert tiny_vocab.decode_bytes(ids) == tiny_tokenizer.decode(ids).encode("utf-8") == text.encode("utf-8")
