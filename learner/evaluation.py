"""Greedy rollouts of held-out records on the training pool, scored by rmsft's own matcher.

`evaluate(trainer, records, images)` asks the trainer's servers (same pool, same version fencing) for
greedy answers to records the learner does not train on, parses them and matches them to the ground
truth: precision, recall and F1 at the matcher's IoU gate. What `benchmarks/local_run.py` plots per
step; the fuller held-out evaluation (COCO mAP, a job setting, tracking) is issue 14's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from learner.core.match import match
from learner.core.parse import parse
from learner.data import Record
from learner.episode import EpisodeStats, ground_truth, predicted_detections, rollout_request, vision_safe_response
from learner.images import ImageStore

if TYPE_CHECKING:
    from learner.trainer import Trainer


@dataclass
class Evaluation:
    stats: dict[float, EpisodeStats]  # IoU gate -> match counts
    predictions: list[list[tuple[str, str, list[float]]]]  # per record: (desc, kind, pixel coords) parsed


def evaluate(trainer: Trainer, records: Sequence[Record], images: ImageStore, *, max_tokens: int | None = None,
             iou_gates: Sequence[float] = ()) -> Evaluation:
    """Match counts of greedy answers to `records` from the weights the servers hold now (rank 0 only), per IoU
    gate: the training matcher's own, plus any in `iou_gates` (e.g. 0.5, the usual detection threshold); and
    the parsed predictions in pixels (for pictures)."""
    if trainer.rollouts is None:
        raise RuntimeError("evaluate runs on rank 0, the rank that talks to the rollout servers")
    requests = [rollout_request(r, [img.data for img in images.load(r)]) for r in records]
    sampling = {"max_tokens": max_tokens or trainer.cfg.rollout.max_tokens, "temperature": 0.0}
    outs = trainer.rollouts.generate(requests, sampling, weight_version=trainer.version)
    vocab, cut = trainer.policy.vocab, trainer.vision_token_ids
    configs = {trainer.core.matching.iou_gate: trainer.core.matching}
    configs.update({g: dataclasses.replace(trainer.core.matching, iou_gate=g) for g in iou_gates})
    stats = {g: EpisodeStats() for g in configs}
    predictions = []
    for rec, out in zip(records, outs, strict=True):
        parsed = parse(vision_safe_response(out.token_ids, cut), vocab)
        predictions.append(predicted_detections(parsed, rec))
        for gate, cfg in configs.items():
            result = match([o.obj for o in parsed.objects], ground_truth(rec), cfg)
            stats[gate] += EpisodeStats(
                rollouts=1, matched=len(result.pairs), false_positives=len(result.false_positives),
                false_negatives=len(result.false_negatives), dropped=parsed.n_dropped,
                truncated=int(parsed.truncated), response_tokens=len(out.token_ids),
            )  # fmt: skip
    return Evaluation(stats, predictions)
