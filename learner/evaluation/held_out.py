"""Held-out evaluation: greedy answers to records the learner does not train on, scored as detections.

`evaluate(client, records, images, setup, version=...)` asks the rollout servers (the training pool,
same version fencing: every answer comes from weight version `version`) for greedy answers, and
`score(...)` parses them with the job's output format and reports:
- **label-aware** F1 (precision, recall) at IoU `iou` (0.5 by default, the usual detection threshold): a
  prediction counts only when it overlaps a ground-truth object enough *and* names it
  (labels compared after `learner.core.clean_prefix.normalize_label`: case, `_`, `/`, brackets and
  spacing do not count), as COCO counts detections. Counted by rmsft's own Hungarian matcher run within
  each label (the same optimum as one matching with pairs of different labels forbidden), only the IoU
  gate changed; also at the training matcher's gate. This is the headline figure;
- **geometry** F1 beside it: the matcher alone, as training matches (labels not compared), so a right
  box with a wrong label counts. The gap between the two is what the model gets wrong in its labels;
- COCO-style bbox mAP (.50:.95, .50, .75) from `learner.evaluation.coco_map` (a well-kept evaluator,
  not hand-written), label-aware (one category per normalized label: the headline mAP) and
  class-agnostic (every object one category). A greedy answer carries no confidence, so each predicted
  object is ranked by the order the model wrote it in (first = most confident); polygons are scored by
  their enclosing box;
- what the answers look like: the share cut by `max_tokens` before they closed (truncation rate), the
  share of predicted objects repeating an earlier one of the same answer (duplicate rate:
  `learner.core.clean_prefix.find_duplicates` with its default `DuplicateConfig`, same normalized label
  and IoU >= 0.9 or centres close), and the mean predicted objects per answer against the mean
  ground-truth objects per record.

The training loop runs it every `training.eval.every` steps and at the end (`TrainingLoop.evaluate_held_out`),
`rmsft eval` runs it offline against servers it starts itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from learner.core.clean_prefix import find_duplicates, normalize_label
from learner.core.codec import COORDEXP, DetObject, OutputFormat
from learner.core.match import MatchConfig, MatchResult, match
from learner.core.parse import parse
from learner.core.vocab import VocabView
from learner.data.episode import (
    Detection,
    EpisodeStats,
    ground_truth,
    ground_truth_detections,
    predicted_detections,
    record_format,
    rollout_request,
    vision_safe_response,
)
from learner.data.images import ImageStore
from learner.data.records import Record
from learner.evaluation.coco_map import boxes_from_detections, coco_map
from learner.evaluation.draw import RolloutPicture
from learner.rollouts.client import RolloutClient
from learner.rollouts.interface import RolloutSource

ImageSize = Callable[[Record], "tuple[int, int] | None"]


@dataclass(frozen=True)
class EvalSetup:
    """What scoring an answer needs besides the servers: the vocabulary and output format the model
    writes, the training matcher, image/video token ids an answer is cut at, and (for a format in
    resized-image pixels) each record's image size as the processor resized it."""

    vocab: VocabView
    fmt: OutputFormat = COORDEXP
    matching: MatchConfig = field(default_factory=MatchConfig)
    vision_ids: frozenset[int] = frozenset()
    image_size: ImageSize | None = None

    def format_for(self, record: Record) -> OutputFormat:
        return record_format(self.fmt, self.image_size(record) if self.image_size is not None else None)


def match_by_label(pred: Sequence[DetObject], gt: Sequence[DetObject], cfg: MatchConfig) -> MatchResult:
    """rmsft's matcher (`learner.core.match.match`, IoU cost, gate, unmatched costs) within each normalized
    label: a prediction can only be paired with ground truth of its own label. Every cost belongs to one
    label's objects, so this is the optimum of one matching with pairs of different labels forbidden."""
    groups: dict[str, tuple[list[int], list[int]]] = {}
    for i, o in enumerate(pred):
        groups.setdefault(normalize_label(o.desc), ([], []))[0].append(i)
    for j, o in enumerate(gt):
        groups.setdefault(normalize_label(o.desc), ([], []))[1].append(j)
    pairs: list[tuple[int, int, float]] = []
    fn: list[int] = []
    fp: list[int] = []
    for preds, gts in groups.values():
        r = match([pred[i] for i in preds], [gt[j] for j in gts], cfg)
        pairs += [(preds[p], gts[g], v) for p, g, v in r.pairs]
        fn += [gts[g] for g in r.false_negatives]
        fp += [preds[p] for p in r.false_positives]
    return MatchResult(tuple(sorted(pairs, key=lambda p: p[1])), tuple(sorted(fn)), tuple(sorted(fp)))


@dataclass(frozen=True)
class HeldOutFigures:
    """One evaluation's figures, what the end-of-run summary prints (learner.train.results.Summary.held_out)."""

    step: int
    f1: float  # label-aware, at the evaluation's IoU
    f1_geometry: float  # labels not compared
    map: float  # label-aware COCO mAP .50:.95
    map_agnostic: float  # class-agnostic
    truncation_rate: float  # share of answers cut by max_tokens
    duplicate_rate: float  # share of predicted objects that repeat an earlier one of their answer
    predicted_per_answer: float
    gt_per_record: float

    @property
    def count_ratio(self) -> float:
        """Predicted objects per ground-truth object (1: as many as there are)."""
        return self.predicted_per_answer / self.gt_per_record if self.gt_per_record else 0.0


@dataclass
class Evaluation:
    step: int
    iou: float  # IoU threshold of `f1`
    # IoU gate -> match counts (`iou` and the training matcher's gate), label-aware: the headline
    stats: dict[float, EpisodeStats]
    coco: dict[str, float]  # label-aware (a category per normalized label): map, map_50, map_75, mar, counts
    records: list[Record]
    predictions: list[list[Detection]]  # per record: parsed objects in the record's pixels
    answers: list[list[int]]  # per record: the answer's token ids
    geometry: dict[float, EpisodeStats] = field(default_factory=dict)  # the same gates, labels not compared
    coco_agnostic: dict[str, float] = field(default_factory=dict)  # every object one category
    # per record, label-aware at `iou`: (matched, false positives, false negatives); what a paired comparison of
    # two models on the same records resamples (studies/method/method_compare.py)
    per_record: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def answer_stats(self) -> EpisodeStats:
        """Counts of the answers themselves (truncated, predicted, duplicates, ...), the same at every gate."""
        return self.stats[self.iou]

    @property
    def f1(self) -> float:
        """Label-aware F1 at `iou`: the headline."""
        return self.stats[self.iou].f1

    @property
    def f1_geometry(self) -> float:
        return self.geometry[self.iou].f1

    @property
    def map(self) -> float:
        """Label-aware COCO mAP .50:.95: the headline mAP."""
        return self.coco["map"]

    @property
    def map_agnostic(self) -> float:
        return self.coco_agnostic["map"]

    def figures(self) -> HeldOutFigures:
        at = self.answer_stats
        n = max(at.rollouts, 1)
        return HeldOutFigures(
            step=self.step,
            f1=self.f1,
            f1_geometry=self.f1_geometry,
            map=self.map,
            map_agnostic=self.map_agnostic,
            truncation_rate=at.truncation_rate,
            duplicate_rate=at.duplicate_rate,
            predicted_per_answer=at.predicted / n,
            gt_per_record=at.gt_objects / n,
        )

    def scalars(self) -> dict[str, float]:
        """The figures, named as TensorBoard tags (`eval/f1`, `eval/map`: label-aware)."""
        at, geo = self.stats[self.iou], self.geometry[self.iou]
        out = {
            "eval/f1": at.f1,
            "eval/precision": at.precision,
            "eval/recall": at.recall,
            "eval/f1_geometry": geo.f1,
            "eval/precision_geometry": geo.precision,
            "eval/recall_geometry": geo.recall,
            "eval/map": self.coco["map"],
            "eval/map_50": self.coco["map_50"],
            "eval/map_75": self.coco["map_75"],
            "eval/map_agnostic": self.coco_agnostic["map"],
            "eval/map_50_agnostic": self.coco_agnostic["map_50"],
        }
        for gate, st in self.stats.items():
            if gate != self.iou:
                out[f"eval/f1_iou{gate:g}"] = st.f1
                out[f"eval/f1_geometry_iou{gate:g}"] = self.geometry[gate].f1
        fig = self.figures()
        if at.rollouts:
            out.update(
                {
                    "eval/truncation_rate": fig.truncation_rate,
                    "eval/duplicate_rate": fig.duplicate_rate,
                    "eval/predicted_per_answer": fig.predicted_per_answer,
                    "eval/gt_per_record": fig.gt_per_record,
                    "eval/predicted_per_gt": fig.count_ratio,
                    "eval/dropped_per_answer": at.dropped / at.rollouts,
                }
            )
        return out

    def describe(self) -> str:
        at, geo, fig = self.stats[self.iou], self.geometry[self.iou], self.figures()
        return (
            f"held-out label-aware F1@{self.iou:g} {at.f1:.3f} (P {at.precision:.3f} R {at.recall:.3f}), "
            f"geometry F1 {geo.f1:.3f}, mAP {self.coco['map']:.3f} mAP50 {self.coco['map_50']:.3f} "
            f"(class-agnostic mAP {self.coco_agnostic['map']:.3f}); truncated {fig.truncation_rate:.1%}, "
            f"duplicates {fig.duplicate_rate:.1%}, objects {fig.predicted_per_answer:.2f}/answer vs "
            f"{fig.gt_per_record:.2f} true, on {len(self.records)} record(s)"
        )

    def pictures(self, images: ImageStore, limit: int, label: str = "held-out") -> list[RolloutPicture]:
        """The first `limit` records with an image, their answer and ground truth drawn."""
        out: list[RolloutPicture] = []
        for rec, pred in zip(self.records, self.predictions, strict=True):
            if len(out) >= limit:
                break
            if rec.images:
                out.append(
                    RolloutPicture(
                        step=self.step,
                        record_id=rec.id,
                        image=images.load(rec)[0].pil(),
                        ground_truth=ground_truth_detections(rec),
                        predicted=pred,
                        title=f"{label} {rec.id}, step {self.step}",
                    )
                )
        return out


def _one_category(_label: str) -> str:
    return "object"


def score(
    records: Sequence[Record], answers: Sequence[Sequence[int]], setup: EvalSetup, *, iou: float = 0.5, step: int = 0
) -> Evaluation:
    """Parse and score one answer per record (pure: no servers)."""
    if len(records) != len(answers):
        raise ValueError(f"{len(records)} record(s) but {len(answers)} answer(s)")
    configs = {setup.matching.iou_gate: setup.matching, iou: dataclasses.replace(setup.matching, iou_gate=iou)}
    stats = {g: EpisodeStats() for g in configs}
    geometry = {g: EpisodeStats() for g in configs}
    predictions: list[list[Detection]] = []
    per_record: list[tuple[int, int, int]] = []
    cut = [vision_safe_response(a, setup.vision_ids) for a in answers]
    for rec, ids in zip(records, cut, strict=True):
        fmt = setup.format_for(rec)
        parsed = parse(ids, setup.vocab, fmt)
        predictions.append(predicted_detections(parsed, rec))
        gt = ground_truth(rec, fmt)  # as the format writes it (qwen_json: polygons as their boxes)
        objs = [o.obj for o in parsed.objects]
        answer = EpisodeStats(
            rollouts=1,
            dropped=parsed.n_dropped,
            truncated=int(parsed.truncated),
            response_tokens=len(ids),
            predicted=len(objs),
            gt_objects=len(gt),
            duplicates=len(find_duplicates(objs)),
        )
        for gate, cfg in configs.items():
            for into, result in ((stats, match_by_label(objs, gt, cfg)), (geometry, match(objs, gt, cfg))):
                into[gate] += dataclasses.replace(
                    answer,
                    matched=len(result.pairs),
                    false_positives=len(result.false_positives),
                    false_negatives=len(result.false_negatives),
                )
                if gate == iou and into is stats:
                    per_record.append((len(result.pairs), len(result.false_positives), len(result.false_negatives)))
    # Written order as confidence (a greedy answer has no other): the first object ranks first.
    truth = [boxes_from_detections(ground_truth_detections(r), rank_by_order=False) for r in records]
    ranked = [boxes_from_detections(p) for p in predictions]
    sizes = [(r.width, r.height) for r in records]
    return Evaluation(
        step=step,
        iou=iou,
        stats=stats,
        coco=coco_map(truth, ranked, sizes, category=normalize_label),
        records=list(records),
        predictions=predictions,
        answers=[list(a) for a in cut],
        geometry=geometry,
        coco_agnostic=coco_map(truth, ranked, sizes, category=_one_category),
        per_record=per_record,
    )


def evaluate(
    client: RolloutSource | RolloutClient,
    records: Sequence[Record],
    images: ImageStore,
    setup: EvalSetup,
    *,
    version: int | None,
    max_tokens: int,
    iou: float = 0.5,
    step: int = 0,
) -> Evaluation:
    """Greedy answers to `records` from the servers holding weight version `version` (None: whatever the
    servers hold, for a model served as it is), scored."""
    requests = [rollout_request(r, [img.data for img in images.load(r)]) for r in records]
    outs = client.generate(requests, {"max_tokens": max_tokens, "temperature": 0.0}, weight_version=version)
    return score(records, [o.token_ids for o in outs], setup, iou=iou, step=step)
