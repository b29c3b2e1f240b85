"""The built-in GRPO rewards, named in a job spec by their short names (`learner.rewards.scoring` resolves them),
and the pure scoring they are made of.

Detection reward (`DetectionReward`): the predicted objects (`parsed.objects`) are matched to the record's
ground truth as the format writes it (`learner.data.episode.ground_truth`) by rmsft's matcher
(`learner.core.match.match`, Hungarian on 1 - IoU with the IoU gate); then
- `metric="f1"`: F1 at the matcher's gate, `2 * matched / (n_pred + n_gt)`;
- `metric="mean_iou"`: the IoU of each matched pair summed, over `n_gt + n_false_positives` (every unmatched
  ground-truth object, and every unmatched prediction, counts as 0; `penalize_false_positives=False`
  divides by `n_gt` alone, which a model can raise by answering more boxes);
- empty cases, both metrics: no ground truth and no prediction = 1.0 (nothing to find, nothing claimed);
  either side empty and the other not = 0.0;
- labels: `labels="ignore"` (default) compares geometry only, as the rollout-matching F1 and the held-out
  evaluation's F1 do (the reward's F1 is the same figure); `labels="match"` matches each label's objects
  among themselves (exact strings, after the core's stripping), so a box with the wrong label is a
  false positive and a miss;
- the format term (`format_score`): 0.0 when the answer did not parse to a closed container (cut by the
  length limit, `finish_reason == "length"`, or broken JSON or garbage before the closing bracket), else
  the fraction of its entries that were valid (1.0 for an empty, closed container). The objects parsed
  before a failure still count in the metric (partial credit);
- reward = `(1 - format_weight) * metric + format_weight * format_score`, in [0, 1].

Text answers (`TextMatchReward`): the expected answer is `RewardInput.answer` when set, else the record's
`answer` attribute (`getattr(record, "answer", None)`; `learner.data.records.Record.answer`, a string or a list of
accepted answers, the best counting). Both sides are normalized (`normalize_answer`: whitespace stripped
and collapsed, casefolded by default, punctuation and English articles dropped on request); equal = 1.0,
else `partial_weight` times the token-level F1 of their words (SQuAD's), or 0.0 with `partial="none"`.
`partial_weight` defaults to 0.5 so the exact answer always scores above a reordering of its words.

Both are thread-safe (no state is written after construction), as `learner.rewards.scoring.score_batch` needs.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from learner.core.codec import DetObject
from learner.core.match import MatchConfig, match
from learner.core.parse import ParsedRollout
from learner.data.episode import ground_truth
from learner.rewards.interface import Reward, RewardInput

# ------------------------------------------------------------------------------------------ pure scoring


def format_score(parsed: ParsedRollout, finish_reason: str | None = None) -> float:
    """1.0 for a well-formed answer; 0.0 when it did not close (cut by the length limit, broken JSON,
    garbage before the closing bracket); otherwise the fraction of its entries that were valid."""
    if parsed.truncated or finish_reason == "length":
        return 0.0
    if parsed.n_entries == 0:
        return 1.0
    return 1.0 - parsed.n_dropped / parsed.n_entries


def _matched_ious(
    pred: Sequence[DetObject], gt: Sequence[DetObject], cfg: MatchConfig, labels: Literal["ignore", "match"]
) -> list[float]:
    """IoU of every matched (pred, gt) pair by rmsft's matcher, across all objects or label by label."""
    if labels == "ignore":
        return [iou for _, _, iou in match(pred, gt, cfg).pairs]
    out: list[float] = []
    for label in sorted({o.desc for o in pred} | {o.desc for o in gt}):
        p = [o for o in pred if o.desc == label]
        g = [o for o in gt if o.desc == label]
        if p and g:
            out.extend(iou for _, _, iou in match(p, g, cfg).pairs)
    return out


def detection_metric(
    pred: Sequence[DetObject],
    gt: Sequence[DetObject],
    *,
    metric: Literal["f1", "mean_iou"] = "f1",
    matching: MatchConfig | None = None,
    labels: Literal["ignore", "match"] = "ignore",
    penalize_false_positives: bool = True,
) -> float:
    """F1 at the matcher's IoU gate, or the mean IoU of matched objects (unmatched ones count 0); both empty
    = 1.0, one side empty = 0.0. See the module docstring."""
    n_pred, n_gt = len(pred), len(gt)
    if n_pred == 0 and n_gt == 0:
        return 1.0
    if n_pred == 0 or n_gt == 0:
        return 0.0
    ious = _matched_ious(pred, gt, matching or MatchConfig(), labels)
    if metric == "f1":
        return 2.0 * len(ious) / (n_pred + n_gt)
    if metric == "mean_iou":
        denom = n_gt + (n_pred - len(ious) if penalize_false_positives else 0)
        return sum(ious) / denom
    raise ValueError(f"metric: expected 'f1' or 'mean_iou', got {metric!r}")


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str, *, casefold: bool = True, punctuation: bool = False, articles: bool = False) -> str:
    """Whitespace stripped and collapsed; casefolded; with `punctuation`, ASCII punctuation removed; with
    `articles`, the English articles a/an/the removed (SQuAD's normalization is all of them)."""
    if casefold:
        text = text.casefold()
    if punctuation:
        text = text.translate(_PUNCT)
    if articles:
        text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD's token-level F1 of two (normalized) strings' whitespace-separated words, counted with
    multiplicity; two empty strings = 1.0, one empty = 0.0."""
    p, r = prediction.split(), reference.split()
    if not p or not r:
        return float(p == r)
    same = sum((Counter(p) & Counter(r)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(r)
    return 2 * precision * recall / (precision + recall)


# ---------------------------------------------------------------------------------------------- built-ins


def _check_choice(param: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{param}: expected one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_unit(param: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{param}: expected a number in [0, 1], got {value!r}")
    return float(value)


class DetectionReward:
    """`detection`: the metric of the parsed objects against the ground truth by rmsft's matcher, mixed with
    the format term; see the module docstring. `iou_gate` overrides `matching`'s gate (default: the
    matcher's default config)."""

    name = "detection"

    def __init__(
        self,
        metric: Literal["f1", "mean_iou"] = "f1",
        format_weight: float = 0.1,
        *,
        iou_gate: float | None = None,
        labels: Literal["ignore", "match"] = "ignore",
        penalize_false_positives: bool = True,
        matching: MatchConfig | None = None,
    ) -> None:
        _check_choice("metric", metric, ("f1", "mean_iou"))
        _check_choice("labels", labels, ("ignore", "match"))
        self.metric = metric
        self.format_weight = _check_unit("format_weight", format_weight)
        self.labels = labels
        self.penalize_false_positives = bool(penalize_false_positives)
        cfg = matching or MatchConfig()
        if iou_gate is not None:
            cfg = dataclasses.replace(cfg, iou_gate=_check_unit("iou_gate", iou_gate))
        self.matching = cfg

    def __call__(self, inp: RewardInput) -> float:
        if inp.parsed is None or inp.fmt is None:
            raise ValueError(
                "the detection reward needs the parsed completion and its output format "
                "(RewardInput.from_completion with vocab= and fmt=)"
            )
        pred = [o.obj for o in inp.parsed.objects]
        metric = detection_metric(
            pred,
            ground_truth(inp.record, inp.fmt),
            metric=self.metric,
            matching=self.matching,
            labels=self.labels,
            penalize_false_positives=self.penalize_false_positives,
        )
        fmt_score = format_score(inp.parsed, inp.finish_reason)
        return (1.0 - self.format_weight) * metric + self.format_weight * fmt_score


class TextMatchReward:
    """`text_match`: 1.0 for the expected answer (after `normalize_answer`), else partial credit; see the
    module docstring for where the expected answer comes from."""

    name = "text_match"

    def __init__(
        self,
        *,
        casefold: bool = True,
        punctuation: bool = False,
        articles: bool = False,
        partial: Literal["token_f1", "none"] = "token_f1",
        partial_weight: float = 0.5,
    ) -> None:
        _check_choice("partial", partial, ("token_f1", "none"))
        self.casefold, self.punctuation, self.articles = bool(casefold), bool(punctuation), bool(articles)
        self.partial = partial
        self.partial_weight = _check_unit("partial_weight", partial_weight)

    def _norm(self, text: str) -> str:
        return normalize_answer(text, casefold=self.casefold, punctuation=self.punctuation, articles=self.articles)

    @staticmethod
    def references(inp: RewardInput) -> tuple[str, ...]:
        ref = inp.answer if inp.answer is not None else getattr(inp.record, "answer", None)
        if ref is None:
            raise ValueError("no expected answer: set RewardInput.answer or give the record an `answer` field")
        refs = (ref,) if isinstance(ref, str) else tuple(ref)
        if not refs or not all(isinstance(r, str) for r in refs):
            raise ValueError(f"the expected answer must be a string or a non-empty list of strings, got {ref!r}")
        return refs

    def __call__(self, inp: RewardInput) -> float:
        pred = self._norm(inp.text)
        refs = [self._norm(r) for r in self.references(inp)]
        if pred in refs:
            return 1.0
        if self.partial == "none":
            return 0.0
        return self.partial_weight * max(token_f1(pred, r) for r in refs)


BUILTIN_REWARDS: Mapping[str, Callable[..., Reward]] = {
    "detection": DetectionReward,
    "text_match": TextMatchReward,
}
