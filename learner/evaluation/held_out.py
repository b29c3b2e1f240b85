"""Held-out evaluation: greedy answers to records the learner does not train on, scored as detections.

`evaluate(client, records, images, setup, version=...)` asks the rollout servers (the training pool,
same version fencing: every answer comes from weight version `version`) for greedy answers, and
`score(...)` parses them with the job's output format and reports:
- F1 (precision, recall) at IoU `iou` (0.5 by default, the usual detection threshold), counted by
  rmsft's own Hungarian matcher with only the IoU gate changed, and at the training matcher's gate;
- COCO-style bbox mAP (.50:.95, .50, .75) from `learner.evaluation.coco_map` (a well-kept evaluator,
  not hand-written). A greedy answer carries no confidence, so each predicted object is ranked by the
  order the model wrote it in (first = most confident); polygons are scored by their enclosing box.

The trainer runs it every `training.eval.every` steps and at the end (`Trainer.evaluate_held_out`),
`rmsft eval` runs it offline against servers it starts itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from learner.core.codec import COORDEXP, OutputFormat
from learner.core.match import MatchConfig, match
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


@dataclass
class Evaluation:
    step: int
    iou: float  # IoU threshold of `f1`
    stats: dict[float, EpisodeStats]  # IoU gate -> match counts (`iou` and the training matcher's gate)
    coco: dict[str, float]  # map, map_50, map_75
    records: list[Record]
    predictions: list[list[Detection]]  # per record: parsed objects in the record's pixels
    answers: list[list[int]]  # per record: the answer's token ids

    @property
    def f1(self) -> float:
        return self.stats[self.iou].f1

    @property
    def map(self) -> float:
        return self.coco["map"]

    def scalars(self) -> dict[str, float]:
        """The figures, named as TensorBoard tags."""
        at = self.stats[self.iou]
        out = {"eval/f1": at.f1, "eval/precision": at.precision, "eval/recall": at.recall,
               "eval/map": self.coco["map"], "eval/map_50": self.coco["map_50"], "eval/map_75": self.coco["map_75"]}
        for gate, st in self.stats.items():
            if gate != self.iou:
                out[f"eval/f1_iou{gate:g}"] = st.f1
        total = sum(st.rollouts for st in self.stats.values()) // max(1, len(self.stats))
        if total:
            out["eval/truncated_share"] = at.truncated / total
            out["eval/dropped_per_answer"] = at.dropped / total
        return out

    def describe(self) -> str:
        at = self.stats[self.iou]
        return (f"held-out F1@{self.iou:g} {at.f1:.3f} (P {at.precision:.3f} R {at.recall:.3f}) "
                f"mAP {self.coco['map']:.3f} mAP50 {self.coco['map_50']:.3f} on {len(self.records)} record(s)")

    def pictures(self, images: ImageStore, limit: int, label: str = "held-out") -> list[RolloutPicture]:
        """The first `limit` records with an image, their answer and ground truth drawn."""
        out = []
        for rec, pred in zip(self.records, self.predictions, strict=True):
            if len(out) >= limit:
                break
            if rec.images:
                out.append(RolloutPicture(step=self.step, record_id=rec.id, image=images.load(rec)[0].pil(),
                                          ground_truth=ground_truth_detections(rec), predicted=pred,
                                          title=f"{label} {rec.id}, step {self.step}"))
        return out


def score(records: Sequence[Record], answers: Sequence[Sequence[int]], setup: EvalSetup, *, iou: float = 0.5,
          step: int = 0) -> Evaluation:
    """Parse and score one answer per record (pure: no servers)."""
    if len(records) != len(answers):
        raise ValueError(f"{len(records)} record(s) but {len(answers)} answer(s)")
    configs = {setup.matching.iou_gate: setup.matching, iou: dataclasses.replace(setup.matching, iou_gate=iou)}
    stats = {g: EpisodeStats() for g in configs}
    predictions: list[list[Detection]] = []
    cut = [vision_safe_response(a, setup.vision_ids) for a in answers]
    for rec, ids in zip(records, cut, strict=True):
        fmt = setup.format_for(rec)
        parsed = parse(ids, setup.vocab, fmt)
        predictions.append(predicted_detections(parsed, rec))
        gt = ground_truth(rec, fmt)  # as the format writes it (qwen_json: polygons as their boxes)
        for gate, cfg in configs.items():
            result = match([o.obj for o in parsed.objects], gt, cfg)
            stats[gate] += EpisodeStats(
                rollouts=1, matched=len(result.pairs), false_positives=len(result.false_positives),
                false_negatives=len(result.false_negatives), dropped=parsed.n_dropped,
                truncated=int(parsed.truncated), response_tokens=len(ids),
            )  # fmt: skip
    # Written order as confidence (a greedy answer has no other): the first object ranks first.
    coco = coco_map([boxes_from_detections(ground_truth_detections(r), rank_by_order=False) for r in records],
                    [boxes_from_detections(p) for p in predictions],
                    [(r.width, r.height) for r in records])
    return Evaluation(step=step, iou=iou, stats=stats, coco=coco, records=list(records), predictions=predictions,
                      answers=[list(a) for a in cut])


def evaluate(client: RolloutClient, records: Sequence[Record], images: ImageStore, setup: EvalSetup, *,
             version: int | None, max_tokens: int, iou: float = 0.5, step: int = 0) -> Evaluation:
    """Greedy answers to `records` from the servers holding weight version `version` (None: whatever the
    servers hold, for a model served as it is), scored."""
    requests = [rollout_request(r, [img.data for img in images.load(r)]) for r in records]
    outs = client.generate(requests, {"max_tokens": max_tokens, "temperature": 0.0}, weight_version=version)
    return score(records, [o.token_ids for o in outs], setup, iou=iou, step=step)
