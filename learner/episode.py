"""One E-step's worth of pure work: rollouts + ground truth -> training segments + match counts.

No I/O: the training loop hands in the completions it got from the servers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from learner.core.codec import DetObject
from learner.core.match import MatchConfig, match
from learner.core.parse import parse
from learner.core.targets import Segment, TargetConfig, build_targets
from learner.core.vocab import VocabView
from learner.data import Record


@dataclass
class EpisodeStats:
    rollouts: int = 0
    matched: int = 0
    false_positives: int = 0
    false_negatives: int = 0
    dropped: int = 0
    truncated: int = 0
    response_tokens: int = 0
    parse_s: float = 0.0
    match_s: float = 0.0
    targets_s: float = 0.0

    def __iadd__(self, other: EpisodeStats) -> EpisodeStats:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    @property
    def precision(self) -> float:
        n = self.matched + self.false_positives
        return self.matched / n if n else 0.0

    @property
    def recall(self) -> float:
        n = self.matched + self.false_negatives
        return self.matched / n if n else 0.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0


def ground_truth(record: Record) -> list[DetObject]:
    """A record's objects on the 1000-bin grid of its own image size."""
    out = []
    for o in record.objects:
        kind, coords = ("bbox_2d", o.bbox_2d) if o.bbox_2d is not None else ("poly", o.poly)
        out.append(DetObject.from_pixels(o.desc, kind, coords, record.width, record.height))
    return out


def build_segments(
    records: Sequence[Record],
    prompt_ids: Sequence[Sequence[int]],
    rollout_prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    vocab: VocabView,
    matching: MatchConfig,
    targets: TargetConfig | None = None,
) -> tuple[list[Segment], EpisodeStats]:
    """Parse, match and build Y_train for each (record, rollout) pair, in order."""
    if not len(records) == len(prompt_ids) == len(rollout_prompt_ids) == len(response_ids):
        raise ValueError("records, prompts and rollouts differ in number")
    stats = EpisodeStats()
    segments = []
    for rec, p_ids, r_p_ids, resp in zip(records, prompt_ids, rollout_prompt_ids, response_ids, strict=True):
        gt = ground_truth(rec)
        t0 = time.perf_counter()
        parsed = parse(resp, vocab)
        t1 = time.perf_counter()
        result = match([o.obj for o in parsed.objects], gt, matching)
        t2 = time.perf_counter()
        segments.append(build_targets(p_ids, parsed, result, gt, vocab, rollout_prompt_ids=r_p_ids, cfg=targets))
        t3 = time.perf_counter()
        stats += EpisodeStats(
            rollouts=1,
            matched=len(result.pairs),
            false_positives=len(result.false_positives),
            false_negatives=len(result.false_negatives),
            dropped=parsed.n_dropped,
            truncated=int(parsed.truncated),
            response_tokens=len(resp),
            parse_s=t1 - t0,
            match_s=t2 - t1,
            targets_s=t3 - t2,
        )
    return segments, stats
