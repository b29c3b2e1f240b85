"""GRPO rewards (learner/rewards/: interface.py, builtins.py, scoring.py): hand-computed detection rewards on
completions parsed by the real parser in both output formats, the format term, text answers, resolution by name
(built-in, import path, entry point), weighted sums, and batch scoring (order, errors naming reward and record)."""

from __future__ import annotations

import importlib.metadata
import threading

import pytest

from learner.core.codec import COORDEXP, QWEN_JSON, QwenJsonFormat
from learner.core.match import MatchConfig
from learner.core.vocab import VocabView
from learner.data.records import Record
from learner.rewards.builtins import DetectionReward, TextMatchReward, detection_metric, format_score, token_f1
from learner.rewards.interface import RewardConfigError, RewardError, RewardInput, UnknownRewardError
from learner.rewards.scoring import ENTRY_POINT_GROUP, RewardSpec, RewardSum, build_rewards, resolve_reward, score_batch


@pytest.fixture(scope="module")
def coord_vocab() -> VocabView:
    from rmsft_dev.tiny_model import build_tokenizer

    return VocabView.from_hf_tokenizer(build_tokenizer(0))


@pytest.fixture(scope="module")
def stock_vocab() -> VocabView:
    from rmsft_dev.tiny_model import build_tokenizer

    return VocabView.from_hf_tokenizer(build_tokenizer(0, coord_tokens=False), coord_tokens=False)


def _record(rid: str, objects: list[dict], width: int = 1000, height: int = 1000) -> Record:
    return Record.model_validate(
        {
            "id": rid,
            "width": width,
            "height": height,
            "objects": objects,
            "messages": [{"role": "user", "content": "Detect."}],
        }
    )


# A 1000x1000 image: pixels are bins. cat: IoU 0.5 with the answer below (half its height); dog: exact;
# bird: missed; the answer's fish: a false positive.
GT = [
    {"desc": "cat", "bbox_2d": [0, 0, 100, 100]},
    {"desc": "dog", "bbox_2d": [200, 200, 300, 300]},
    {"desc": "bird", "bbox_2d": [500, 500, 600, 600]},
]


def _c(*bins: int) -> str:
    return ", ".join(f'"<|coord_{b}|>"' for b in bins)


COORDEXP_ANSWER = (
    '{"object_1": {"desc": "cat", "bbox_2d": [' + _c(0, 0, 100, 50) + "]}, "
    '"object_2": {"desc": "dog", "bbox_2d": [' + _c(200, 200, 300, 300) + "]}, "
    '"object_3": {"desc": "fish", "bbox_2d": [' + _c(800, 800, 900, 900) + "]}}"
)
QWEN_ANSWER = (
    '[{"bbox_2d": [0, 0, 100, 50], "label": "cat"}, {"bbox_2d": [200, 200, 300, 300], "label": "dog"}, '
    '{"bbox_2d": [800, 800, 900, 900], "label": "fish"}]'
)


def _inp(rec: Record, text: str, vocab: VocabView, fmt, *, eos: bool = True, **kw) -> RewardInput:
    ids = list(vocab.encode(text)) + ([vocab.eos_id] if eos else [])
    return RewardInput.from_completion(rec, text, ids, vocab=vocab, fmt=fmt, **kw)


@pytest.fixture(params=["coordexp", "qwen_json"])
def answer(request, coord_vocab, stock_vocab):
    """The same three objects written in each format, parsed by the real parser."""
    if request.param == "coordexp":
        return _inp(_record("r1", GT), COORDEXP_ANSWER, coord_vocab, COORDEXP)
    return _inp(_record("r1", GT), QWEN_ANSWER, stock_vocab, QWEN_JSON)


def test_parsed_answer_is_what_was_written(answer: RewardInput) -> None:
    assert [o.desc for o in answer.objects] == ["cat", "dog", "fish"]
    assert answer.objects[0].bins == (0, 0, 100, 50)
    assert format_score(answer.parsed, answer.finish_reason) == 1.0


def test_f1_by_hand(answer: RewardInput) -> None:
    # 3 predictions, 3 ground truth; matched at gate 0.3: cat (IoU .5), dog (IoU 1) -> F1 = 2*2/(3+3) = 2/3.
    assert DetectionReward("f1", format_weight=0.0)(answer) == pytest.approx(2 / 3)
    # With the format term (well-formed: 1.0) at weight 0.1: 0.9 * 2/3 + 0.1 = 0.7.
    assert DetectionReward("f1", format_weight=0.1)(answer) == pytest.approx(0.7)
    # A gate above the cat's IoU leaves it unmatched: F1 = 2*1/6 = 1/3.
    assert DetectionReward("f1", 0.0, iou_gate=0.6)(answer) == pytest.approx(1 / 3)
    assert DetectionReward("f1", 0.0, matching=MatchConfig(iou_gate=0.6))(answer) == pytest.approx(1 / 3)


def test_mean_iou_by_hand(answer: RewardInput) -> None:
    # Matched IoUs .5 and 1; unmatched bird and fish count 0: (0.5 + 1) / (3 gt + 1 false positive) = 0.375.
    assert DetectionReward("mean_iou", 0.0)(answer) == pytest.approx(0.375)
    # Over the ground truth alone: 1.5 / 3.
    assert DetectionReward("mean_iou", 0.0, penalize_false_positives=False)(answer) == pytest.approx(0.5)
    assert DetectionReward("mean_iou", 0.2)(answer) == pytest.approx(0.8 * 0.375 + 0.2)


def test_labels_match_pairs_within_a_label(coord_vocab: VocabView) -> None:
    rec = _record("lab", GT[:2])
    # Both boxes exact, both called "dog": geometry alone matches both; label by label only the real dog.
    text = (
        '{"object_1": {"desc": "dog", "bbox_2d": [' + _c(0, 0, 100, 100) + "]}, "
        '"object_2": {"desc": "dog", "bbox_2d": [' + _c(200, 200, 300, 300) + "]}}"
    )
    inp = _inp(rec, text, coord_vocab, COORDEXP)
    assert DetectionReward("f1", 0.0)(inp) == 1.0
    assert DetectionReward("f1", 0.0, labels="match")(inp) == pytest.approx(2 * 1 / 4)
    assert DetectionReward("mean_iou", 0.0, labels="match")(inp) == pytest.approx(1 / 3)  # 1 / (2 gt + 1 fp)


def test_qwen_json_compares_ground_truth_as_written(stock_vocab: VocabView) -> None:
    # A polygon is asked for as its enclosing box in qwen_json; pixels format bound to the resized image.
    rec = _record("poly", [{"desc": "tri", "poly": [0, 0, 200, 0, 100, 400]}], width=2000, height=1000)
    fmt = QwenJsonFormat(coordinates="pixels")
    inp = _inp(rec, '[{"bbox_2d": [0, 0, 50, 200], "label": "tri"}]', stock_vocab, fmt, image_size=(500, 500))
    assert inp.fmt == fmt.for_image(500, 500)
    assert inp.objects[0].bins == (0, 0, 100, 400)
    assert DetectionReward("mean_iou", 0.0)(inp) == pytest.approx(1.0)


def test_parse_failure_costs_the_format_term(coord_vocab: VocabView, stock_vocab: VocabView) -> None:
    rec = _record("r2", GT)
    # Cut inside the second entry: the cat still counts (F1 = 2*1/(1+3) = 0.5), the format scores 0.
    cut = COORDEXP_ANSWER[: COORDEXP_ANSWER.index('"object_2"') + 30]
    inp = _inp(rec, cut, coord_vocab, COORDEXP, eos=False, finish_reason="length")
    assert inp.parsed.truncated and [o.desc for o in inp.objects] == ["cat"]
    assert format_score(inp.parsed, inp.finish_reason) == 0.0
    assert DetectionReward("f1", 0.1)(inp) == pytest.approx(0.9 * 0.5)
    assert DetectionReward("f1", 1.0)(inp) == 0.0

    # Closed but never stopped (cut by the length limit right after the bracket): still a format failure.
    closed = _inp(rec, COORDEXP_ANSWER, coord_vocab, COORDEXP, eos=False, finish_reason="length")
    assert not closed.parsed.truncated
    assert DetectionReward("f1", 0.1)(closed) == pytest.approx(0.9 * 2 / 3)

    # No JSON at all: nothing parsed, metric 0, format 0.
    prose = _inp(rec, "I see a cat and a dog.", coord_vocab, COORDEXP)
    assert prose.objects == () and DetectionReward("f1", 0.1)(prose) == 0.0

    # One entry of two invalid (reversed corners: dropped, never repaired): format 1 - 1/2.
    bad = _inp(
        _record("r3", GT[:1]),
        '[{"bbox_2d": [0, 0, 100, 100], "label": "cat"}, {"bbox_2d": [300, 0, 200, 100], "label": "dog"}]',
        stock_vocab,
        QWEN_JSON,
    )
    assert bad.parsed.n_dropped == 1
    assert format_score(bad.parsed) == 0.5
    assert DetectionReward("f1", 0.5)(bad) == pytest.approx(0.5 * 1.0 + 0.5 * 0.5)


def test_empty_cases(coord_vocab: VocabView, stock_vocab: VocabView) -> None:
    empty = _record("e", [])
    both = _inp(empty, "[]", stock_vocab, QWEN_JSON)
    assert DetectionReward("f1", 0.1)(both) == 1.0 and DetectionReward("mean_iou", 0.1)(both) == 1.0
    assert DetectionReward("f1", 0.1)(_inp(empty, "{}", coord_vocab, COORDEXP)) == 1.0
    claimed = _inp(empty, '[{"bbox_2d": [0, 0, 10, 10], "label": "cat"}]', stock_vocab, QWEN_JSON)
    assert DetectionReward("f1", 0.1)(claimed) == pytest.approx(0.1)  # metric 0, format 1
    missed = _inp(_record("m", GT), "[]", stock_vocab, QWEN_JSON)
    assert DetectionReward("mean_iou", 0.1)(missed) == pytest.approx(0.1)
    assert detection_metric([], []) == 1.0


def test_detection_reward_refuses_bad_params_and_unparsed_input() -> None:
    with pytest.raises(ValueError, match="metric: expected one of 'f1', 'mean_iou', got 'map'"):
        DetectionReward("map")
    with pytest.raises(ValueError, match=r"format_weight: expected a number in \[0, 1\], got 2"):
        DetectionReward(format_weight=2)
    with pytest.raises(RewardError, match="reward 'detection' failed on record 'x' .*needs the parsed"):
        score_batch(DetectionReward(), [RewardInput(_record("x", GT), "{}")])


# ------------------------------------------------------------------------------------------------ text


class QARecord(Record):
    """A record with an expected answer (learner.data.records.Record has no such field yet)."""

    answer: str | list[str]


def _qa(text: str, answer: str | list[str], rid: str = "q1") -> RewardInput:
    rec = QARecord.model_validate(
        {
            "id": rid,
            "width": 1,
            "height": 1,
            "answer": answer,
            "messages": [{"role": "user", "content": "Capital of France?"}],
        }
    )
    return RewardInput(rec, text)


def test_text_exact_and_partial() -> None:
    r = TextMatchReward()
    assert r(_qa("  Paris \n", "paris")) == 1.0
    assert r(_qa("Paris", ["Lyon", "paris"])) == 1.0  # any accepted answer
    assert r(_qa("New   York", "new york")) == 1.0  # whitespace collapsed
    # "the city of paris" vs "paris": 1 word in common, P 1/4, R 1, F1 0.4; partial credit 0.5 * 0.4.
    assert token_f1("the city of paris", "paris") == pytest.approx(0.4)
    assert r(_qa("The city of Paris", "Paris")) == pytest.approx(0.2)
    assert r(_qa("berlin", "paris")) == 0.0
    assert TextMatchReward(partial_weight=1.0)(_qa("york new", "new york")) == 1.0  # same words, other order
    assert TextMatchReward(partial="none")(_qa("The city of Paris", "Paris")) == 0.0
    assert TextMatchReward(casefold=False)(_qa("Paris", "paris")) == 0.0
    assert TextMatchReward(punctuation=True, articles=True)(_qa("The Eiffel Tower!", "eiffel tower")) == 1.0
    # The input's own answer overrides the record's.
    assert r(RewardInput(_record("t", []), "Rome", answer="rome")) == 1.0


def test_text_without_answer_names_the_record() -> None:
    with pytest.raises(
        RewardError,
        match=r"reward 'text_match' failed on record 'plain' \(sample 0\): "
        r"ValueError: no expected answer",
    ):
        score_batch(TextMatchReward(), [RewardInput(_record("plain", []), "x")])


# ------------------------------------------------------------------------------------------- resolution


def test_builtins_by_name() -> None:
    assert isinstance(resolve_reward("detection"), DetectionReward)
    det = resolve_reward("detection", {"metric": "mean_iou", "format_weight": 0.2})
    assert (det.metric, det.format_weight) == ("mean_iou", 0.2)
    with pytest.raises(
        RewardConfigError,
        match=r"reward 'detection': cannot build it with params \{'metrc': 'f1'\}"
        r".*unexpected keyword.*it takes \(metric",
    ):
        resolve_reward("detection", {"metrc": "f1"})


def test_import_path() -> None:
    inp = RewardInput(_record("p", []), "abc", (1, 2, 3))
    import reward_plugins

    assert resolve_reward("reward_plugins:length_reward") is reward_plugins.length_reward
    assert resolve_reward("reward_plugins:ScaledLength", {"scale": 2.0})(inp) == 6.0
    assert resolve_reward("reward_plugins:make_threshold", {"min_tokens": 4})(inp) == 0.0
    with pytest.raises(UnknownRewardError, match="no module named 'no_such_pkg'"):
        resolve_reward("no_such_pkg.mod:fn")
    with pytest.raises(UnknownRewardError, match="'reward_plugins' has no attribute 'nope'.*length_reward"):
        resolve_reward("reward_plugins:nope")
    with pytest.raises(RewardConfigError, match="resolved to int 42, not a callable"):
        resolve_reward("reward_plugins:NOT_CALLABLE")


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, *pairs: tuple[str, str]) -> list[str]:
    groups: list[str] = []

    def entry_points(**kw):
        groups.append(kw.get("group"))
        return importlib.metadata.EntryPoints(
            importlib.metadata.EntryPoint(name, value, kw.get("group")) for name, value in pairs
        )

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return groups


def test_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    groups = _fake_entry_points(
        monkeypatch,
        ("scaled", "reward_plugins:ScaledLength"),
        ("broken", "no_such_module_xyz:fn"),
        ("detection", "reward_plugins:length_reward"),
    )
    reward = resolve_reward("scaled", {"scale": 0.5})
    assert groups == [ENTRY_POINT_GROUP]
    assert reward(RewardInput(_record("p", []), "", (7, 7))) == 1.0
    assert isinstance(resolve_reward("detection"), DetectionReward)  # a built-in name wins
    with pytest.raises(
        UnknownRewardError,
        match="entry point 'no_such_module_xyz:fn' of group 'rmsft.rewards' failed to load: ModuleNotFoundError",
    ):
        resolve_reward("broken")
    with pytest.raises(UnknownRewardError) as err:
        resolve_reward("bleu")
    msg = str(err.value)
    assert "unknown reward 'bleu'" in msg and "built-in (detection, text_match)" in msg
    assert "group 'rmsft.rewards' (installed: broken, detection, scaled)" in msg and "package.module:callable" in msg


def test_entry_point_name_clash(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, ("dup", "a.b:c"), ("dup", "d.e:f"))
    with pytest.raises(RewardConfigError, match="2 entry points .* have that name \\(a.b:c, d.e:f\\)"):
        resolve_reward("dup")


# ----------------------------------------------------------------------------------------- specs and sums


def test_spec_from_mapping() -> None:
    spec = RewardSpec.from_mapping({"name": "detection", "metric": "f1", "format_weight": 0.1, "weight": 2})
    assert spec == RewardSpec("detection", {"metric": "f1", "format_weight": 0.1}, 2.0)
    assert RewardSpec.from_mapping({"name": "x", "params": {"a": 1}}).params == {"a": 1}
    assert RewardSpec.from_mapping("text_match") == RewardSpec("text_match")
    assert RewardSpec.from_mapping(spec.to_mapping()) == spec
    with pytest.raises(RewardConfigError, match="params.a: given both"):
        RewardSpec.from_mapping({"name": "x", "a": 1, "params": {"a": 2}})
    with pytest.raises(RewardConfigError, match="weight: expected a finite number, got nan"):
        RewardSpec("x", weight=float("nan"))
    with pytest.raises(RewardConfigError, match="name: missing"):
        RewardSpec.from_mapping({"metric": "f1"})


def test_build_rewards_weighted_sum(coord_vocab: VocabView) -> None:
    total = build_rewards(
        [
            {"name": "detection", "format_weight": 0.0, "weight": 2.0},
            {"name": "reward_plugins:length_reward", "weight": -0.01},
            {"name": "detection", "metric": "mean_iou", "format_weight": 0.0},
        ]
    )
    assert isinstance(total, RewardSum)
    assert total.labels == ("detection#0", "reward_plugins:length_reward", "detection#2")
    inp = _inp(_record("w", GT), COORDEXP_ANSWER, coord_vocab, COORDEXP)
    n = len(inp.token_ids)
    assert total.scores(inp) == pytest.approx(
        {"detection#0": 2 / 3, "reward_plugins:length_reward": n, "detection#2": 0.375}
    )
    assert total(inp) == pytest.approx(2 * 2 / 3 - 0.01 * n + 0.375)
    with pytest.raises(RewardConfigError, match=r"rewards\[1\] \(detection\): reward 'detection': cannot build"):
        build_rewards(["text_match", {"name": "detection", "iou": 0.5}])
    with pytest.raises(UnknownRewardError, match=r"rewards\[0\] \(nope\): unknown reward 'nope'"):
        build_rewards(["nope"])
    with pytest.raises(RewardConfigError, match="at least one"):
        build_rewards([])


# ---------------------------------------------------------------------------------------------- batches


def test_score_batch_keeps_input_order_on_a_pool() -> None:
    total = build_rewards(["reward_plugins:slow_index", {"name": "reward_plugins:length_reward", "weight": 10}])
    inputs = [RewardInput(_record(f"r{i}", []), "", (0,) * i, sample_index=i) for i in range(10)]
    seen: set[str] = set()
    orig = total.scores

    def spy(inp):
        seen.add(threading.current_thread().name)
        return orig(inp)

    total.scores = spy  # type: ignore[method-assign]
    out = score_batch(total, inputs, workers=4)
    assert out.per_reward["reward_plugins:slow_index"] == tuple(float(i) for i in range(10))
    assert out.totals == tuple(i + 10.0 * i for i in range(10))
    assert any(name.startswith("rmsft-reward") for name in seen)
    assert score_batch(total, inputs, workers=1) == out
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        score_batch(total, inputs, workers=0)


def test_score_batch_errors_name_reward_and_record() -> None:
    total = build_rewards(["text_match", "reward_plugins:fails_on_bad"])
    inputs = [
        RewardInput(_record(rid, []), "a", answer="a", sample_index=i)
        for i, rid in enumerate(["ok", "bad-1", "ok2", "bad-2"])
    ]
    with pytest.raises(RewardError) as err:
        score_batch(total, inputs, workers=3)
    e = err.value
    assert (e.reward, e.record_id, e.sample_index) == ("reward_plugins:fails_on_bad", "bad-1", 1)
    assert str(e) == (
        "reward 'reward_plugins:fails_on_bad' failed on record 'bad-1' (sample 1): KeyError: 'boom' "
        "(and 1 more failing completion(s) in this batch of 4)"
    )
    assert isinstance(e.__cause__, KeyError)
    with pytest.raises(RewardError, match="reward 'reward_plugins:returns_nan' failed on record 'ok'.*returned nan"):
        score_batch(build_rewards(["reward_plugins:returns_nan"]), inputs[:1])
    # A plain callable, not built from a spec: named by its own name.
    import reward_plugins

    with pytest.raises(RewardError, match="reward 'fails_on_bad' failed on record 'bad-1'"):
        score_batch(reward_plugins.fails_on_bad, inputs[1:2])
    with pytest.raises(RewardError, match="failed on record 'bad-1'"):
        total(inputs[1])  # a sum called directly names the component too
