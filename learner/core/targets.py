"""Y_train and its supervision (DESIGN §3.5-3.6).

Public API
- `build_targets(prompt_ids, parsed, matching, gt, vocab, fmt=COORDEXP, rollout_prompt_ids=None,
  cfg=TargetConfig()) -> Segment`. `fmt` must be the format `parsed` was parsed with (bound to the
  image size for a pixels format), and `gt` the ground truth as that format writes it
  (`fmt.as_written`).
- `Segment`: `input_ids` = prompt + Y_train, `labels` (IGNORE_INDEX = -100 where no cross-entropy),
  `coord_positions` / `coord_bins` (positions in `input_ids` whose token gets the coordinate loss,
  and the target bin), `prompt_len`, `prefix_len`, `meta` counters. Positions index the *target*
  token; the loss reads the logits one position earlier.
- `check_prompt_ids(teacher_forced, rollout)`: raises `PromptMismatchError` if they differ.
- `SegmentVision(mrope_positions, pixel_values=None, image_grid_thw=None)`: what a segment of a
  vision-language model carries besides its ids (`Segment.vision`, None for text-only models). The
  core only validates shapes, carries it and concatenates it (packing); the learner computes it
  (`learner.data.vision`). Attach it with `dataclasses.replace(segment, vision=...)`.

Y_train = prompt + prefix_ids (the rollout's own) + encode(", " + FN entries + closing bracket) +
[eos]: for coordexp the FN entries are numbered from max_object_index + 1 and the bracket is `}`;
for qwen_json they are list elements and the bracket is `]`. The leading ", " only follows a kept
entry (after a bare opener, or a preamble and the opener, the first FN entry comes directly).
Supervision:
- prefix (the rollout's own ids, preamble included): nothing, except the coord tokens of matched
  predictions, pulled to the matched ground-truth bins (only when kind and coord count agree;
  otherwise counted in meta["matched_unsupervised"]); prefix ids the parser wrote itself (past
  `n_own_prefix_ids`: an opening bracket, or a brace split off a fused token) get cross-entropy like
  the tail. A format without coord tokens (qwen_json) supervises nothing in the prefix: its
  coordinates are ordinary text the rollout chose, and cross-entropy on them would need another
  prefix;
- tail: coord tokens get the coordinate loss towards their own (ground-truth) bins, other tokens get
  cross-entropy (for qwen_json that includes the digits of the coordinates), except the desc/label
  value tokens of appended objects when `supervise_fn_desc` is False (CoordExp's default: a missed
  object's name is not something the rollout can be blamed for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from learner.core.codec import COORDEXP, DetObject, OutputFormat, container_brackets
from learner.core.match import MatchResult
from learner.core.parse import ParsedRollout
from learner.core.vocab import VocabView, require_coord_tokens

IGNORE_INDEX = -100


class PromptMismatchError(ValueError):
    """The teacher-forced prompt would not be the prompt the rollout was sampled from."""


class TargetError(ValueError):
    """Inputs that cannot produce a consistent Y_train."""


@dataclass(frozen=True)
class TargetConfig:
    supervise_fn_desc: bool = False


@dataclass(frozen=True, eq=False)
class SegmentVision:
    """A vision-language segment's model inputs besides its ids, as CPU tensors.

    `mrope_positions` [3, len]: the (temporal, height, width) rotary positions of every token of the
    whole segment, prompt and response (response positions continue after the images' positions,
    so they cannot be derived from the prompt alone); text-only segments of a vision-language model
    carry them too. `pixel_values` [patches, features] and `image_grid_thw` [images, 3], both or
    neither: the segment's images in prompt order. Tensors survive `torch.save` and pickling, so a
    checkpoint's packer carry buffer keeps them.
    """

    mrope_positions: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def __post_init__(self) -> None:
        m = self.mrope_positions
        if not isinstance(m, torch.Tensor) or m.ndim != 2 or m.shape[0] != 3 or m.is_floating_point():
            raise TargetError(f"mrope_positions must be an integer tensor of shape [3, len], got {_shape(m)}")
        if (self.pixel_values is None) != (self.image_grid_thw is None):
            raise TargetError("pixel_values and image_grid_thw go together: give both or neither")
        if self.image_grid_thw is not None:
            g, pv = self.image_grid_thw, self.pixel_values
            assert pv is not None, "given together with image_grid_thw (checked above)"
            if g.ndim != 2 or g.shape[1] != 3 or g.shape[0] < 1 or g.is_floating_point():
                raise TargetError(f"image_grid_thw must be an integer tensor of shape [images, 3], got {_shape(g)}")
            if pv.ndim < 1 or pv.shape[0] < 1:
                raise TargetError(f"pixel_values must have a leading patch dimension, got {_shape(pv)}")

    def __eq__(self, other: object) -> bool:
        # Field-wise tensor `==` is elementwise (and ambiguous as a bool): compare values instead, so
        # a segment restored from a checkpoint equals the one saved.
        if not isinstance(other, SegmentVision):
            return NotImplemented
        return all(
            (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))
            for a, b in (
                (self.mrope_positions, other.mrope_positions),
                (self.pixel_values, other.pixel_values),
                (self.image_grid_thw, other.image_grid_thw),
            )
        )

    __hash__ = None  # type: ignore[assignment]  # tensors compare by value: not hashable

    @property
    def n_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])


def _shape(x: object) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


@dataclass(frozen=True)
class Segment:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    coord_positions: tuple[int, ...]
    coord_bins: tuple[int, ...]
    prompt_len: int
    prefix_len: int
    meta: dict = field(default_factory=dict)
    # Vision-language models only (None for text-only ones): see SegmentVision.
    vision: SegmentVision | None = None
    # The second-generation recipe's extras (learner/core/clean_prefix.py); the defaults are the first
    # generation's: every label and coordinate target at weight 1, no unlikelihood, no box terms.
    ce_weights: tuple[float, ...] | None = None  # per position (0 where the label is ignored)
    coord_weights: tuple[float, ...] | None = None  # per coord position
    ul_positions: tuple[int, ...] = ()  # unlikelihood: position whose token `ul_tokens` is pushed down
    ul_tokens: tuple[int, ...] = ()
    box_positions: tuple[tuple[int, ...], ...] = ()  # four coord positions (x1, y1, x2, y2) of a box
    box_bins: tuple[tuple[int, ...], ...] = ()  # its ground-truth bins
    box_weights: tuple[float, ...] = ()

    def __len__(self) -> int:
        return len(self.input_ids)

    def __post_init__(self) -> None:
        if self.vision is not None and self.vision.mrope_positions.shape[1] != len(self.input_ids):
            raise TargetError(
                f"mrope_positions cover {self.vision.mrope_positions.shape[1]} tokens but the segment has "
                f"{len(self.input_ids)}: compute them for the whole segment (prompt and response)"
            )
        if len(self.labels) != len(self.input_ids):
            raise TargetError("labels and input_ids differ in length")
        if len(self.coord_positions) != len(self.coord_bins):
            raise TargetError("coord_positions and coord_bins differ in length")
        # Position 0 has no preceding logit; a target there would leak across packed segments.
        if any(p < 1 or p >= len(self.input_ids) for p in self.coord_positions):
            raise TargetError("coord position outside 1..len-1")
        if self.labels and self.labels[0] != IGNORE_INDEX:
            raise TargetError("the first token of a segment cannot carry a label")
        if self.ce_weights is not None and len(self.ce_weights) != len(self.input_ids):
            raise TargetError("ce_weights and input_ids differ in length")
        if self.coord_weights is not None and len(self.coord_weights) != len(self.coord_positions):
            raise TargetError("coord_weights and coord_positions differ in length")
        if len(self.ul_positions) != len(self.ul_tokens):
            raise TargetError("ul_positions and ul_tokens differ in length")
        if any(p < 1 or p >= len(self.input_ids) for p in self.ul_positions):
            raise TargetError("unlikelihood position outside 1..len-1")
        if not len(self.box_positions) == len(self.box_bins) == len(self.box_weights):
            raise TargetError("box_positions, box_bins and box_weights differ in length")
        coords = set(self.coord_positions)
        for pos, bins in zip(self.box_positions, self.box_bins, strict=True):
            if len(pos) != 4 or len(bins) != 4 or not set(pos) <= coords:
                raise TargetError("a box is four coord positions with four target bins")


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
    require_coord_tokens(vocab, fmt)
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
    for p, g, _ in matching.pairs if fmt.coord_tokens else ():
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
    tail_text = lead + entries + container_brackets(fmt.container)[1]
    tail = list(vocab.encode(tail_text)) + [vocab.eos_id]

    # Which tail tokens are desc values: map character spans to byte spans, then to tokens.
    desc_bytes: list[tuple[int, int]] = []
    if not cfg.supervise_fn_desc:
        base = len(lead.encode())
        for s, e in fmt.desc_value_spans(entries):
            desc_bytes.append((base + len(entries[:s].encode()), base + len(entries[:e].encode())))

    # Coord tokens the tail must hold, in order (none for a plain-text format: any there is an error).
    fn_bins = [b for o in fn for b in o.bins] if fmt.coord_tokens else []
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
    # Prefix ids past `n_own_prefix_ids` were written by the parser, not sampled (the opening bracket
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
