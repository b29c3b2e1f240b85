"""Y_train and its supervision (DESIGN §3.5-3.6).

Public API
- `build_targets(prompt_ids, parsed, matching, gt, vocab, fmt=COORDEXP, rollout_prompt_ids=None,
  cfg=TargetConfig()) -> Segment`.
- `Segment`: `input_ids` = prompt + Y_train, `labels` (IGNORE_INDEX = -100 where no cross-entropy),
  `coord_positions` / `coord_bins` (positions in `input_ids` whose token gets the coordinate loss,
  and the target bin), `prompt_len`, `prefix_len`, `meta` counters. Positions index the *target*
  token; the loss reads the logits one position earlier.
- `check_prompt_ids(teacher_forced, rollout)`: raises `PromptMismatchError` if they differ.

Y_train = prompt + prefix_ids (the rollout's own) + encode(", " + FN entries numbered from
max_object_index + 1 + "}") + [eos]. Supervision:
- prefix (the rollout's own ids): nothing, except the coord tokens of matched predictions, pulled to
  the matched ground-truth bins (only when kind and coord count agree; otherwise counted in
  meta["matched_unsupervised"]); prefix ids the parser wrote itself (past `n_own_prefix_ids`: an
  opening `{`, or a brace split off a fused token) get cross-entropy like the tail;
- tail: coord tokens get the coordinate loss towards their own (ground-truth) bins, other tokens get
  cross-entropy, except the desc value tokens of appended objects when `supervise_fn_desc` is False
  (CoordExp's default: a missed object's name is not something the rollout can be blamed for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from learner.core.codec import COORDEXP, DetObject, OutputFormat
from learner.core.match import MatchResult
from learner.core.parse import ParsedRollout
from learner.core.vocab import VocabView

IGNORE_INDEX = -100


class PromptMismatchError(ValueError):
    """The teacher-forced prompt would not be the prompt the rollout was sampled from."""


class TargetError(ValueError):
    """Inputs that cannot produce a consistent Y_train."""


@dataclass(frozen=True)
class TargetConfig:
    supervise_fn_desc: bool = False


@dataclass(frozen=True)
class Segment:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    coord_positions: tuple[int, ...]
    coord_bins: tuple[int, ...]
    prompt_len: int
    prefix_len: int
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.input_ids):
            raise TargetError("labels and input_ids differ in length")
        if len(self.coord_positions) != len(self.coord_bins):
            raise TargetError("coord_positions and coord_bins differ in length")
        # Position 0 has no preceding logit; a target there would leak across packed segments.
        if any(p < 1 or p >= len(self.input_ids) for p in self.coord_positions):
            raise TargetError("coord position outside 1..len-1")
        if self.labels and self.labels[0] != IGNORE_INDEX:
            raise TargetError("the first token of a segment cannot carry a label")


def check_prompt_ids(teacher_forced: Sequence[int], rollout: Sequence[int]) -> None:
    a, b = list(teacher_forced), list(rollout)
    if a == b:
        return
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    raise PromptMismatchError(
        f"teacher-forced prompt ids differ from the rollout's prompt ids at index {first} "
        f"(lengths {len(a)} vs {len(b)}; ids {a[first : first + 5]} vs {b[first : first + 5]}); "
        "the learner must encode the prompt exactly as the rollout server did"
    )


def _byte_spans(ids: Sequence[int], vocab: VocabView) -> list[tuple[int, int]]:
    spans, pos = [], 0
    for t in ids:
        n = len(vocab.token_bytes[t])
        spans.append((pos, pos + n))
        pos += n
    return spans


def build_targets(
    prompt_ids: Sequence[int],
    parsed: ParsedRollout,
    matching: MatchResult,
    gt: Sequence[DetObject],
    vocab: VocabView,
    fmt: OutputFormat = COORDEXP,
    rollout_prompt_ids: Sequence[int] | None = None,
    cfg: TargetConfig | None = None,
) -> Segment:
    """Build one training segment; `matching` must index `parsed.objects` and `gt`."""
    cfg = cfg or TargetConfig()
    if rollout_prompt_ids is not None:
        check_prompt_ids(prompt_ids, rollout_prompt_ids)
    if len(prompt_ids) < 1:
        raise TargetError("prompt_ids is empty")
    n_pred, n_gt = len(parsed.objects), len(gt)
    for p, g, _ in matching.pairs:
        if not (0 <= p < n_pred and 0 <= g < n_gt):
            raise TargetError(f"match pair ({p}, {g}) outside {n_pred} predictions x {n_gt} ground truths")
    if any(not 0 <= g < n_gt for g in matching.false_negatives):
        raise TargetError("false negative index outside the ground truth")

    prompt_len = len(prompt_ids)
    prefix = list(parsed.prefix_ids)
    prefix_len = len(prefix)
    coord_pos: list[int] = []
    coord_bins: list[int] = []

    unsupervised = 0
    for p, g, _ in matching.pairs:
        pred, target = parsed.objects[p], gt[g]
        if pred.obj.kind != target.kind or len(pred.obj.bins) != len(target.bins):
            unsupervised += 1
            continue
        for tok_index, b in zip(pred.coord_token_indices, target.bins, strict=True):
            if tok_index >= parsed.n_own_prefix_ids:
                raise TargetError("matched coord token outside the kept prefix")
            coord_pos.append(prompt_len + tok_index)
            coord_bins.append(b)

    fn = [gt[g] for g in matching.false_negatives]
    entries = fmt.render_entries(fn, parsed.max_object_index + 1) if fn else ""
    lead = ", " if fn and parsed.n_entries else ""
    tail_text = lead + entries + "}"
    tail = list(vocab.encode(tail_text)) + [vocab.eos_id]

    # Which tail tokens are desc values: map character spans to byte spans, then to tokens.
    desc_bytes: list[tuple[int, int]] = []
    if not cfg.supervise_fn_desc:
        base = len(lead.encode())
        for s, e in fmt.desc_value_spans(entries):
            desc_bytes.append((base + len(entries[:s].encode()), base + len(entries[:e].encode())))

    fn_bins = [b for o in fn for b in o.bins]
    tail_labels: list[int] = []
    k = 0
    tail_start = prompt_len + prefix_len
    for i, (t, (bs, be)) in enumerate(zip(tail, _byte_spans(tail, vocab), strict=True)):
        if t in vocab.coord_bin_of:
            if k >= len(fn_bins) or vocab.coord_bin_of[t] != fn_bins[k]:
                raise TargetError("tail tokenization does not reproduce the missed objects' coord tokens")
            coord_pos.append(tail_start + i)
            coord_bins.append(fn_bins[k])
            k += 1
            tail_labels.append(IGNORE_INDEX)
        elif any(bs < de and ds < be for ds, de in desc_bytes):
            tail_labels.append(IGNORE_INDEX)
        else:
            tail_labels.append(t)
    if k != len(fn_bins):
        raise TargetError("tail tokenization lost coord tokens of the missed objects")

    input_ids = tuple(int(t) for t in prompt_ids) + tuple(prefix) + tuple(tail)
    # Prefix ids past `n_own_prefix_ids` were written by the parser, not sampled (the opening `{`
    # of a rollout with no usable start, or the brace split off a fused `},` token): they are part
    # of the target the model must learn to produce, so they get cross-entropy. Leaving them
    # unlabelled trains a model that never learns to open the JSON object.
    own = prompt_len + parsed.n_own_prefix_ids
    prefix_labels = tuple(int(t) if i >= own else IGNORE_INDEX for i, t in enumerate(prefix, start=prompt_len))
    labels = (IGNORE_INDEX,) * prompt_len + prefix_labels + tuple(tail_labels)
    order = sorted(range(len(coord_pos)), key=coord_pos.__getitem__)
    return Segment(
        input_ids=input_ids,
        labels=labels,
        coord_positions=tuple(coord_pos[i] for i in order),
        coord_bins=tuple(coord_bins[i] for i in order),
        prompt_len=prompt_len,
        prefix_len=prefix_len,
        meta={
            "n_pred": n_pred,
            "n_gt": n_gt,
            "n_matched": len(matching.pairs),
            "n_fn": len(fn),
            "n_fp": len(matching.false_positives),
            "n_dropped": parsed.n_dropped,
            "truncated": parsed.truncated,
            "matched_unsupervised": unsupervised,
        },
    )
