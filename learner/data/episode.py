"""One E-step's worth of pure work: rollouts + ground truth -> training segments + match counts.

No I/O: the training loop hands in the completions it got from the servers.

The output format (`training.format`, `learner.train.config.CoreConfigs.fmt`) is a keyword argument
everywhere it matters, COORDEXP by default. A format in resized-image pixels (qwen_json with
`coordinates: pixels`) is bound per record to the size the processor resized that record's image to
(`image_sizes`); bins stay relative to the image, so `predicted_detections` needs no format.
Prompts are the records' own messages: nothing format-specific is added to them here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from learner.core.clean_prefix import (
    CleanPrefixConfig,
    DuplicateConfig,
    build_clean_targets,
    dead_anchors,
    find_duplicates,
    label_support,
)
from learner.core.codec import COORDEXP, DetObject, FormatError, Kind, OutputFormat, bin_to_pixel
from learner.core.match import MatchConfig, match
from learner.core.parse import ParsedRollout, parse
from learner.core.targets import PromptMismatchError, Segment, TargetConfig, build_targets
from learner.core.vocab import VocabView
from learner.data.records import Record
from learner.rollouts.requests import RolloutRequest


@dataclass
class EpisodeStats:
    rollouts: int = 0
    matched: int = 0
    false_positives: int = 0
    false_negatives: int = 0
    dropped: int = 0
    truncated: int = 0
    response_tokens: int = 0
    predicted: int = 0  # valid objects in the answers (duplicates included)
    gt_objects: int = 0
    duplicates: int = 0  # objects repeating another of the same answer (same label, IoU >= 0.9 ...)
    dead: int = 0  # unmatched objects no explorer supports, left out of the prefix (generation 2)
    recovered: int = 0  # ground truth the anchor missed and an explorer found (generation 2)
    fallback: int = 0  # answers with nothing to keep: trained on the whole ground truth
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

    @property
    def truncation_rate(self) -> float:
        return self.truncated / self.rollouts if self.rollouts else 0.0

    @property
    def duplicate_rate(self) -> float:
        return self.duplicates / self.predicted if self.predicted else 0.0

    @property
    def count_ratio(self) -> float:
        """Predicted objects per ground-truth object (1 when the answers name as many as there are)."""
        return self.predicted / self.gt_objects if self.gt_objects else 0.0


def ground_truth(record: Record, fmt: OutputFormat = COORDEXP) -> list[DetObject]:
    """A record's objects on the 1000-bin grid of its own image size, as `fmt` writes them (qwen_json:
    a polygon becomes its enclosing box), so matching compares what the model is asked to write."""
    out = []
    for o in record.objects:
        kind: Kind
        coords: list[float] | None
        kind, coords = ("bbox_2d", o.bbox_2d) if o.bbox_2d is not None else ("poly", o.poly)
        assert coords is not None, "a Record has exactly one of bbox_2d and poly (validated)"
        out.append(fmt.as_written(DetObject.from_pixels(o.desc, kind, coords, record.width, record.height)))
    return out


def record_format(fmt: OutputFormat, image_size: tuple[int, int] | None) -> OutputFormat:
    """`fmt` bound to a record's resized image size (a no-op for formats that need none)."""
    return fmt.for_image(*image_size) if image_size is not None else fmt


Detection = tuple[str, str, list[float]]  # (desc, "bbox_2d" | "poly", pixel coordinates): what pictures draw


def rollout_request(record: Record, image_bytes: Sequence[bytes], seed: int | None = None) -> RolloutRequest:
    """A record as the servers get it: its chat messages and its images' bytes (the server renders the prompt
    with its own processor and returns the ids it used)."""
    return RolloutRequest(
        seed=seed,
        request_id=record.id,
        messages=[(m.role, m.content) for m in record.messages],
        images=list(image_bytes),
    )


def ground_truth_detections(record: Record) -> list[Detection]:
    return [
        (o.desc, "bbox_2d" if o.bbox_2d is not None else "poly", list(o.bbox_2d or o.poly or []))
        for o in record.objects
    ]


def predicted_detections(parsed: ParsedRollout, record: Record) -> list[Detection]:
    """The objects of a parsed response, in the record's pixel coordinates."""
    return [
        (
            o.obj.desc,
            o.obj.kind,
            [bin_to_pixel(b, record.width if i % 2 == 0 else record.height) for i, b in enumerate(o.obj.bins)],
        )
        for o in parsed.objects
    ]


VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def vision_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokens that stand for image/video content in a Qwen-VL vocabulary."""
    unk = getattr(tokenizer, "unk_token_id", None)
    ids = (tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS)
    return frozenset(int(i) for i in ids if i is not None and i != unk)


def vision_safe_response(response: Sequence[int], vision_ids: frozenset[int]) -> list[int]:
    """The response up to its first image/video token. A model may sample one (a young model samples
    anything), but teacher-forcing it would ask the model for image features no image provides; cut
    there, the parser sees a truncated answer and the targets complete it as they complete any other."""
    for i, t in enumerate(response):
        if t in vision_ids:
            return list(response[:i])
    return list(response)


def check_rollout_prompts(
    records: Sequence[Record], learner_ids: Sequence[Sequence[int]], rollouts: Sequence[Any], tokenizer: Any
) -> None:
    """Refuse a rollout whose server rendered the prompt differently from the learner: training on it
    would teacher-force a prompt the answer was not sampled from. The message says which record, which
    server, where the ids part and what each side has there (decoded), and what usually causes it."""
    for rec, mine, out in zip(records, learner_ids, rollouts, strict=True):
        theirs = list(out.prompt_token_ids)
        if list(mine) == theirs:
            continue
        i = next((k for k, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs)))
        lo = max(0, i - 8)

        def show(ids: Sequence[int], lo: int = lo, i: int = i) -> str:
            return repr(tokenizer.decode(list(ids[lo : i + 8]), skip_special_tokens=False))

        image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        hint = ""
        if sum(t == image_pad for t in mine) != sum(t == image_pad for t in theirs):
            hint = (
                " The image token counts differ: the server's processor resizes images differently (check that "
                "spec.model.vision minPixels/maxPixels reach both, and that both load the same processor)."
            )
        raise PromptMismatchError(
            f"record {rec.id!r}: server {getattr(out, 'server', '?')} rendered a prompt of {len(theirs)} tokens, "
            f"the learner {len(mine)}; they part at token {i}: learner {show(mine)} vs server {show(theirs)}.{hint} "
            "Servers and learner must serve the same model folder (tokenizer, chat template, processor)."
        )


def build_segments(
    records: Sequence[Record],
    prompt_ids: Sequence[Sequence[int]],
    rollout_prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    vocab: VocabView,
    matching: MatchConfig,
    targets: TargetConfig | None = None,
    *,
    fmt: OutputFormat = COORDEXP,
    image_sizes: Sequence[tuple[int, int] | None] | None = None,
    clean: CleanPrefixConfig | None = None,
    duplicates: DuplicateConfig | None = None,
    explorer_ids: Sequence[Sequence[Sequence[int]]] | None = None,
) -> tuple[list[Segment], EpisodeStats]:
    """Parse, match and build Y_train for each (record, rollout) pair, in order. `fmt`: the output
    format; `image_sizes`: per record, its image's (width, height) as the processor resized it (None for a
    record without one), which a pixels format is bound to (`OutputFormat.for_image`).
    `clean` (recipe generation 2): the clean-prefix targets (learner/core/clean_prefix.py), duplicates found
    with `duplicates` taken out of the prefix; `explorer_ids`: per record, its explorers' responses (the
    ground truth they find and the answer missed gets the recovered weight). Without `clean`: the first
    generation's targets (learner/core/targets.py)."""
    if not len(records) == len(prompt_ids) == len(rollout_prompt_ids) == len(response_ids):
        raise ValueError("records, prompts and rollouts differ in number")
    if image_sizes is not None and len(image_sizes) != len(records):
        raise ValueError(f"{len(image_sizes)} image size(s) for {len(records)} record(s)")
    if explorer_ids is not None and len(explorer_ids) != len(records):
        raise ValueError(f"explorer responses for {len(explorer_ids)} record(s), not {len(records)}")
    sizes = image_sizes if image_sizes is not None else [None] * len(records)
    explorers = explorer_ids if explorer_ids is not None else [()] * len(records)
    dup_cfg = duplicates or DuplicateConfig()
    stats = EpisodeStats()
    segments = []
    for rec, p_ids, r_p_ids, resp, size, extra in zip(
        records, prompt_ids, rollout_prompt_ids, response_ids, sizes, explorers, strict=True
    ):
        rec_fmt = record_format(fmt, size)
        try:
            gt = ground_truth(rec, rec_fmt)
            t0 = time.perf_counter()
            parsed = parse(resp, vocab, rec_fmt)
            t1 = time.perf_counter()
            objects = [o.obj for o in parsed.objects]
            recovered: set[int] = set()
            dead: list[int] = []  # indices into `objects`
            dead_kept: frozenset[int] = frozenset()  # the same, as indices into the kept objects
            if clean is None:
                dups = find_duplicates(objects, dup_cfg)
                result = match(objects, gt, matching)
            else:  # the clean prefix: duplicates out before matching, then dead anchors out after it
                views = [[o.obj for o in parse(ids, vocab, rec_fmt).objects] for ids in extra]
                dups = find_duplicates(objects, dup_cfg, label_support(objects, views, dup_cfg.support_iou))
                kept = [i for i in range(len(objects)) if i not in dups]
                result = match([objects[i] for i in kept], gt, matching)
                found = [match(view, gt, matching) for view in views]  # each explorer's own answer, as it is
                for f in found:
                    recovered |= {g for _, g, _ in f.pairs}
                recovered &= set(result.false_negatives)
                if clean.dead_anchors:
                    dead_kept = frozenset(
                        dead_anchors(
                            [objects[i] for i in kept],
                            result,
                            [(v, set(f.gt_of_pred())) for v, f in zip(views, found, strict=True)],
                            dup_cfg.support_iou,
                            verified=rec.lvis.verified() if rec.lvis is not None else (),
                        )
                    )
                    dead = [kept[j] for j in sorted(dead_kept)]
            t2 = time.perf_counter()
            if clean is None:
                seg = build_targets(p_ids, parsed, result, gt, vocab, rec_fmt, rollout_prompt_ids=r_p_ids, cfg=targets)
            else:
                kept_result = result.without_predictions(dead_kept)
                seg = build_clean_targets(
                    p_ids,
                    parsed,
                    dups,
                    kept_result,
                    gt,
                    vocab,
                    rec_fmt,
                    rollout_prompt_ids=r_p_ids,
                    cfg=clean,
                    recovered=recovered,
                    dead=dead,
                )
            segments.append(seg)
        except FormatError as exc:  # e.g. a pixels format and a record without an image size
            raise FormatError(f"record {rec.id!r}: {exc}") from exc
        t3 = time.perf_counter()
        stats += EpisodeStats(
            rollouts=1,
            matched=len(result.pairs),
            false_positives=len(result.false_positives),
            false_negatives=len(result.false_negatives),
            dropped=parsed.n_dropped,
            truncated=int(parsed.truncated),
            response_tokens=len(resp),
            predicted=len(objects),
            gt_objects=len(gt),
            duplicates=len(dups),
            dead=len(dead),
            recovered=len(recovered),
            fallback=int(clean is not None and len(objects) == len(dups) + len(dead)),
            parse_s=t1 - t0,
            match_s=t2 - t1,
            targets_s=t3 - t2,
        )
    return segments, stats
