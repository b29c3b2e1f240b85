"""training.format coordjson: the reference's CoordJSON answer (`{"objects": [{"desc": ..., "bbox_2d":
[<|coord_k|>, ...]}]}`, bare coordinate tokens) through render, parse, targets and the clean prefix."""

from __future__ import annotations

import json
import re

import pytest

from learner.core.clean_prefix import CleanPrefixConfig, DuplicateConfig, build_clean_targets, find_duplicates
from learner.core.codec import COORDEXP, COORDJSON, DetObject, output_format
from learner.core.match import MatchConfig, match
from learner.core.parse import parse
from learner.core.targets import IGNORE_INDEX, build_targets

CAT = DetObject("cat", "bbox_2d", (12, 56, 200, 512))
DOG = DetObject("dog", "bbox_2d", (500, 500, 700, 700))
TRI = DetObject("triangle", "poly", (1, 2, 3, 4, 5, 6))
PROMPT = [5, 6, 7]


def strict_json(text: str) -> dict:
    """The reference's CoordJSON -> strict JSON conversion: each bare coord token read as its bin."""
    return json.loads(re.sub(r"<\|coord_(\d+)\|>", r"\1", text))


def ids(vocab, text, eos=True):
    return list(vocab.encode(text)) + ([vocab.eos_id] if eos else [])


def test_render_matches_the_references_golden_strings():
    assert COORDJSON.render([CAT]) == (
        '{"objects": [{"desc": "cat", "bbox_2d": [<|coord_12|>, <|coord_56|>, <|coord_200|>, <|coord_512|>]}]}'
    )
    assert COORDJSON.render([TRI]) == (
        '{"objects": [{"desc": "triangle", "poly": [<|coord_1|>, <|coord_2|>, '
        "<|coord_3|>, <|coord_4|>, <|coord_5|>, <|coord_6|>]}]}"
    )
    assert COORDJSON.render([]) == '{"objects": []}'
    assert strict_json(COORDJSON.render([CAT, TRI]))["objects"][1] == {"desc": "triangle", "poly": [1, 2, 3, 4, 5, 6]}
    assert output_format("coordjson") is COORDJSON


@pytest.mark.parametrize("vocab_name", ["tiny_vocab", "fused"])
def test_parse_round_trips_and_the_coord_tokens_are_located(request, vocab_name):
    vocab = request.getfixturevalue(vocab_name)
    response = ids(vocab, COORDJSON.render([CAT, TRI, DOG]))
    p = parse(response, vocab, COORDJSON)
    assert [o.obj for o in p.objects] == [CAT, TRI, DOG]
    assert p.closed and not p.truncated and p.n_dropped == 0 and p.max_object_index == 3
    for o in p.objects:
        assert [vocab.coord_bin_of[response[i]] for i in o.coord_token_indices] == list(o.obj.bins)
    # The prefix ends with the last complete record: its own ids, the closer left for the targets to append.
    assert vocab.decode_bytes(p.prefix_ids).decode() + "]}" == COORDJSON.render([CAT, TRI, DOG])
    # A stage-1 checkpoint of the reference writes this; read as coordexp it is nothing (the silent loss),
    # and a coordexp answer read as coordjson is nothing too.
    assert parse(response, vocab, COORDEXP).objects == ()
    assert parse(ids(vocab, COORDEXP.render([CAT, DOG])), vocab, COORDJSON).objects == ()


@pytest.mark.parametrize("vocab_name", ["tiny_vocab", "fused"])
def test_records_the_reference_drops_are_dropped(request, vocab_name):
    vocab = request.getfixturevalue(vocab_name)
    c = [f"<|coord_{k}|>" for k in (12, 56, 200, 512)]
    good = '{"desc": "cat", "bbox_2d": [' + ", ".join(c) + "]}"
    bad = [
        '{"desc": "cat", "bbox_2d": [' + ", ".join(f'"{t}"' for t in c) + "]}",  # quoted tokens
        '{"desc": "cat", "bbox_2d": [12, 56, 200, 512]}',  # integers
        '{"desc": "cat", "bbox_2d": [' + ", ".join(c[:3]) + "]}",  # three coordinates
        '{"desc": "tri", "poly": [[<|coord_1|>, <|coord_2|>], [<|coord_3|>, <|coord_4|>], [<|coord_5|>, '
        "<|coord_6|>]]}",  # nested pairs
        '{"desc": "cat", "bbox_2d": [' + ", ".join(c) + '], "score": 1}',  # another key
        '{"desc": "<|coord_3|>", "bbox_2d": [' + ", ".join(c) + "]}",  # a coord token in the desc
    ]
    geometry_first = '{"bbox_2d": [' + ", ".join(c) + '], "desc": "dog"}'  # the other field order: read
    text = '{"objects": [' + ", ".join([good, *bad, geometry_first]) + "]}"
    p = parse(ids(vocab, text), vocab, COORDJSON)
    assert [o.obj.desc for o in p.objects] == ["cat", "dog"]
    assert p.n_dropped == len(bad) and p.closed


@pytest.mark.parametrize("vocab_name", ["tiny_vocab", "fused"])
def test_a_cut_answer_keeps_its_complete_records_and_the_prefix_closes_to_coordjson(request, vocab_name):
    vocab = request.getfixturevalue(vocab_name)
    full = COORDJSON.render([CAT, DOG])
    cut = full[: full.index("<|coord_700|>")]  # inside DOG's box
    p = parse(ids(vocab, "Sure: " + cut, eos=False), vocab, COORDJSON)
    assert [o.obj for o in p.objects] == [CAT] and p.truncated and not p.closed
    prefix = vocab.decode_bytes(p.prefix_ids).decode()
    assert prefix.startswith("Sure: ") and strict_json(prefix.removeprefix("Sure: ") + "]}")["objects"] == [
        {"desc": "cat", "bbox_2d": [12, 56, 200, 512]}
    ]
    # Nothing complete, or not even the opener: the prefix is the opener the parser writes.
    for text in ('{"objects": [{"desc": "ca', '{"obj', '{"things": []}'):
        q = parse(ids(vocab, text, eos=False), vocab, COORDJSON)
        assert q.objects == () and vocab.decode_bytes(q.prefix_ids).decode() == '{"objects": ['


def _response_text(vocab, seg):
    return vocab.decode_bytes([t for t in seg.input_ids[len(PROMPT) :] if t != vocab.eos_id]).decode()


@pytest.mark.parametrize("vocab_name", ["tiny_vocab", "fused"])
def test_targets_append_the_missed_objects_in_coordjson(request, vocab_name):
    vocab = request.getfixturevalue(vocab_name)
    near_cat = DetObject("kitten", "bbox_2d", (14, 56, 200, 510))
    p = parse(ids(vocab, COORDJSON.render([near_cat])), vocab, COORDJSON)
    m = match([o.obj for o in p.objects], [CAT, DOG, TRI])
    seg = build_targets(PROMPT, p, m, [CAT, DOG, TRI], vocab, COORDJSON)
    text = _response_text(vocab, seg)
    assert text == COORDJSON.render([near_cat, DOG, TRI])
    assert strict_json(text)["objects"][1] == {"desc": "dog", "bbox_2d": [500, 500, 700, 700]}
    # Coordinate targets: the kitten's four tokens get the cat's bins, then every appended coordinate.
    assert list(seg.coord_bins) == [*CAT.bins, *DOG.bins, *TRI.bins]
    assert all(seg.labels[i] == IGNORE_INDEX for i in seg.coord_positions)  # coordinate terms, not CE
    assert [vocab.coord_bin_of[seg.input_ids[i]] for i in seg.coord_positions[4:]] == [*DOG.bins, *TRI.bins]


@pytest.mark.parametrize("vocab_name", ["tiny_vocab", "fused"])
def test_the_clean_prefix_is_coordjson(request, vocab_name):
    vocab = request.getfixturevalue(vocab_name)
    wrong = DetObject("cow", "bbox_2d", (800, 50, 900, 150))
    p = parse(ids(vocab, COORDJSON.render([CAT, CAT, wrong])), vocab, COORDJSON)
    objs = [o.obj for o in p.objects]
    dups = find_duplicates(objs, DuplicateConfig())
    assert dups == {1: 0}
    kept = [o for i, o in enumerate(objs) if i not in dups]
    m = match(kept, [CAT, DOG], MatchConfig(iou_gate=0.5, fp_cost=1.0, fn_cost=1.2))
    seg = build_clean_targets(PROMPT, p, dups, m, [CAT, DOG], vocab, COORDJSON, cfg=CleanPrefixConfig())
    text = _response_text(vocab, seg)
    assert text == COORDJSON.render([CAT, wrong, DOG])
    assert len(seg.ul_positions) == 1 and seg.box_positions  # the duplicate's unlikelihood term, box terms
    # Every coordinate target sits on a coord token of the response.
    assert all(seg.input_ids[i] in vocab.coord_bin_of for i in seg.coord_positions)
