"""Channel B of the second-generation recipe: a clean prefix, duplicate control, closure (DESIGN §7).

Public API
- `normalize_label(desc) -> str`: lower case, `_ / ( )` as spaces, single spaces: "the same label".
- `DuplicateConfig(iou=0.9, center_radius=0.8, clusters=True, support_iou=0.9, spread=2.5)`;
  `find_duplicates(objects, cfg, support=None) -> dict[int, int]`: duplicate index -> the object of the answer
  that stays in its place. Two objects are duplicate-like when they have the same normalized label, and IoU >=
  `iou` or centres closer than `center_radius * sqrt(max(1, min(area_a, area_b)))` (bins of the 1000-bin grid: a
  radius that scales with the objects' size). With `clusters` (the reference's rule, the default) the
  duplicate-like pairs are joined into clusters (connected components); a cluster stays whole when two or more of
  its members are supported by an explorer (`support`: per object, the explorer answers holding it, from
  `label_support`) or when it is spread wide (two members' centres farther apart than `spread * center_radius *
  sqrt(max(1, largest area))`: a row of like objects, not a burst on one); else one member survives (the most
  supported, then one not touching the grid's border, then the first) and the others are duplicates. Without
  `clusters`: greedy in answer order, each object against the earlier kept ones (the first of a burst stays).
- `label_support(objects, explorers, min_iou) -> list[int]`: per object, how many explorer answers hold an
  object of the same label at IoU >= `min_iou` in a one-to-one pairing (duplicate exemptions and survivor).
- `dead_anchors(kept, kept_matching, explorers, min_iou) -> list[int]`: the kept objects no ground truth and no
  explorer supports ("dead anchors", left out of the prefix). An unmatched kept object is supported by an
  explorer answer when the one-to-one IoU pairing of the kept objects with that answer's (labels not compared)
  pairs it at IoU >= `min_iou` with an object the explorer did not match to the ground truth, and it is not
  itself at IoU >= `min_iou` with a matched kept object. `explorers`: per explorer answer, its objects and the
  indices of those it matched to the ground truth.
- `CleanPrefixConfig(structure_ce=1.0, supervise_fn_desc=True, unlikelihood=True, recovered_weight=2.0,
  geometry=True, prefix_labels=True, dead_anchors=True)`.
- `build_clean_targets(prompt_ids, parsed, duplicates, kept_matching, gt, vocab, fmt, rollout_prompt_ids,
  cfg, recovered, dead) -> Segment`. `kept_matching` matches the kept objects (answer order, duplicates and
  dead anchors left out) to `gt`; `recovered`: ground-truth indices the anchor missed and an explorer found;
  `dead`: indices of parsed objects left out of the prefix with no other term (dead anchors).

Y_train = prompt + encode(opener) + encode(entries of the kept objects, then the missed ground truth,
numbered 1.., + closer) + [eos]: the prefix is the model's own objects (its choice, order and place of
every valid object that is neither a duplicate nor a dead anchor) written canonically, so an object can be
taken out of the middle and nothing invalid or truncated stays in it. With dead anchors out, "close" is
trained right after the last object that ground truth or an explorer supports, not after a hallucination.
With no kept object (an invalid, empty or unparseable answer, or only duplicates and dead anchors) it
is exactly the ground-truth target of channel A (and of a warm-start step).
Supervision (weights per position; a weight 0 is no supervision):
- opener, separators and every non-coordinate token of kept entries (keys, braces, punctuation, and with
  `prefix_labels` their labels, as the reference's code does): cross-entropy at `structure_ce`; an unmatched
  kept object's coordinates: nothing (the model's own, neither right nor wrong as far as the ground truth
  knows); a matched object's coordinates: the coordinate loss towards its ground-truth bins (and the box
  terms). Without `prefix_labels` kept labels get nothing (matching is geometry only);
- appended missed objects: cross-entropy on structure, on the label when `supervise_fn_desc`, the
  coordinate loss on coordinates; `recovered` ones (missed by this answer, found by an explorer) with
  their label and coordinate terms at `recovered_weight`;
- the closing bracket and eos: always cross-entropy at weight 1 (what keeps answers from growing);
- each duplicate: an unlikelihood term on the first token where the answer with that duplicate put back
  at its place diverges from Y_train (the token the model chose that started the repeat).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from learner.core.codec import COORDEXP, NUM_BINS, DetObject, OutputFormat, container_brackets
from learner.core.match import MatchResult, iou, pair_by_iou
from learner.core.parse import ParsedRollout
from learner.core.targets import (
    IGNORE_INDEX,
    Segment,
    TargetError,
    _byte_spans,
    check_prompt_ids,
)
from learner.core.vocab import VocabView, require_coord_tokens

_LABEL_SEPARATORS = str.maketrans({c: " " for c in "_/()"})


def normalize_label(desc: str) -> str:
    return " ".join(desc.lower().translate(_LABEL_SEPARATORS).split())


@dataclass(frozen=True)
class DuplicateConfig:
    iou: float = 0.9
    center_radius: float = 0.8  # times sqrt(the smaller area, in bins^2); 0 = IoU alone
    clusters: bool = True  # the reference's clusters with exemptions; False: greedy in answer order
    support_iou: float = 0.9  # an explorer's object at this IoU (same label) supports an object
    spread: float = 2.5  # a cluster wider than spread * center_radius * sqrt(largest area) is a row, kept

    def __post_init__(self) -> None:
        if not 0.0 < self.iou <= 1.0:
            raise ValueError(f"duplicate iou must be in (0, 1], got {self.iou}")
        if self.center_radius < 0:
            raise ValueError(f"duplicate center_radius must be >= 0, got {self.center_radius}")
        if not 0.0 < self.support_iou <= 1.0:
            raise ValueError(f"support_iou must be in (0, 1], got {self.support_iou}")
        if self.spread <= 0:
            raise ValueError(f"spread must be > 0, got {self.spread}")


def _center(o: DetObject) -> tuple[float, float]:
    xs, ys = o.bins[0::2], o.bins[1::2]
    return (min(xs) + max(xs)) / 2.0, (min(ys) + max(ys)) / 2.0


def _area(o: DetObject) -> float:
    xs, ys = o.bins[0::2], o.bins[1::2]
    return float(max(xs) - min(xs)) * float(max(ys) - min(ys))


def is_duplicate(a: DetObject, b: DetObject, cfg: DuplicateConfig) -> bool:
    if normalize_label(a.desc) != normalize_label(b.desc):
        return False
    if cfg.center_radius > 0:
        (ax, ay), (bx, by) = _center(a), _center(b)
        if math.hypot(ax - bx, ay - by) <= cfg.center_radius * math.sqrt(max(1.0, min(_area(a), _area(b)))):
            return True
    return iou(a, b) >= cfg.iou


def _touches_border(o: DetObject) -> bool:
    return any(b in (0, NUM_BINS - 1) for b in o.bins)


def find_duplicates(
    objects: Sequence[DetObject], cfg: DuplicateConfig | None = None, support: Sequence[int] | None = None
) -> dict[int, int]:
    cfg = cfg or DuplicateConfig()
    if support is not None and len(support) != len(objects):
        raise ValueError(f"support for {len(support)} object(s), not {len(objects)}")
    if not cfg.clusters:
        kept: list[int] = []
        dups: dict[int, int] = {}
        for i, o in enumerate(objects):
            first = next((k for k in kept if is_duplicate(o, objects[k], cfg)), None)
            if first is None:
                kept.append(i)
            else:
                dups[i] = first
        return dups
    sup = list(support) if support is not None else [0] * len(objects)
    root = list(range(len(objects)))  # union-find over duplicate-like pairs

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for i in range(len(objects)):
        for j in range(i + 1, len(objects)):
            if is_duplicate(objects[i], objects[j], cfg):
                root[find(j)] = find(i)
    clusters: dict[int, list[int]] = {}
    for i in range(len(objects)):
        clusters.setdefault(find(i), []).append(i)
    dups = {}
    for members in clusters.values():
        if (
            len(members) < 2
            or sum(1 for m in members if sup[m] > 0) >= 2
            or _spread_wide([objects[m] for m in members], cfg)
        ):
            continue
        survivor = min(members, key=lambda m: (-sup[m], _touches_border(objects[m]), m))
        dups.update({m: survivor for m in members if m != survivor})
    return dups


def _spread_wide(members: Sequence[DetObject], cfg: DuplicateConfig) -> bool:
    """Two members' centres farther apart than `spread * center_radius * sqrt(max(1, largest area))`: a row
    of like objects side by side, not a burst on one object (off without a centre radius)."""
    if cfg.center_radius <= 0:
        return False
    limit = cfg.spread * cfg.center_radius * math.sqrt(max(1.0, max(_area(o) for o in members)))
    centers = [_center(o) for o in members]
    return any(
        math.hypot(ax - bx, ay - by) > limit for k, (ax, ay) in enumerate(centers) for bx, by in centers[k + 1 :]
    )


def label_support(objects: Sequence[DetObject], explorers: Sequence[Sequence[DetObject]], min_iou: float) -> list[int]:
    """Per object, the explorer answers that hold it: an object of the same normalized label paired with it at IoU
    >= `min_iou` in a one-to-one pairing of the highest total IoU."""
    support = [0] * len(objects)
    labels = [normalize_label(o.desc) for o in objects]
    for view in explorers:
        same = np.array([[a == normalize_label(b.desc) for b in view] for a in labels], dtype=bool).reshape(
            len(objects), len(view)
        )
        for i in pair_by_iou(objects, view, min_iou, same):
            support[i] += 1
    return support


def dead_anchors(
    kept: Sequence[DetObject],
    kept_matching: MatchResult,
    explorers: Sequence[tuple[Sequence[DetObject], Collection[int]]],
    min_iou: float,
    verified: Collection[str] = (),
) -> list[int]:
    """Indices of `kept` unmatched and supported by no explorer answer (see the module docstring), and, as the
    reference's triage does with LVIS's metadata, unmatched ones whose category the image's annotation verified
    (`verified`: normalized names, `LvisMeta.verified`): every instance of such a category is in the ground truth
    (or none is), so an unmatched one is wrong whatever the explorers say."""
    matched = set(kept_matching.gt_of_pred())
    unmatched = [i for i in range(len(kept)) if i not in matched]
    checked = {i for i in unmatched if verified and normalize_label(kept[i].desc) in verified}
    # An unmatched object that repeats a matched one is not supported by the explorer's copy of that one.
    free = [i for i in unmatched if all(iou(kept[i], kept[m]) < min_iou for m in matched)]
    supported: set[int] = set()
    for view, view_matched in explorers:
        pairs = pair_by_iou(kept, view, min_iou)
        supported |= {i for i in free if i in pairs and pairs[i] not in view_matched}
    return [i for i in unmatched if i not in supported or i in checked]


@dataclass(frozen=True)
class CleanPrefixConfig:
    structure_ce: float = 1.0
    supervise_fn_desc: bool = True
    unlikelihood: bool = True
    recovered_weight: float = 2.0
    geometry: bool = True  # box groups (expected-value SmoothL1 + CIoU) for matched and appended boxes
    prefix_labels: bool = True  # CE (at structure_ce) on the labels of kept objects, as the reference's code
    dead_anchors: bool = True  # unmatched kept objects no explorer supports leave the prefix (the caller finds them)

    def __post_init__(self) -> None:
        if self.structure_ce < 0:
            raise ValueError(f"structure_ce must be >= 0, got {self.structure_ce}")
        if self.recovered_weight <= 0:
            raise ValueError(f"recovered_weight must be > 0, got {self.recovered_weight}")


@dataclass(frozen=True)
class _Part:
    """One entry of the response: where its text sits in the body and how it is supervised."""

    obj: DetObject  # as written in Y_train
    start: int  # byte offsets in the body
    end: int
    desc_spans: tuple[tuple[int, int], ...]
    kind: str  # "kept" | "fn"
    target_bins: tuple[int, ...] | None  # coordinate targets, None = no coordinate loss
    desc_supervised: bool
    weight: float  # of its label and coordinate terms (structure stays at 1 in the tail)


def _body(fmt: OutputFormat, objects: Sequence[DetObject]) -> tuple[str, list[tuple[int, int, list]]]:
    """The entries of `objects` numbered 1.. and the closing bracket; per entry its byte span and desc spans."""
    close = container_brackets(fmt.container)[1]
    pieces, spans, pos = [], [], 0
    for i, o in enumerate(objects):
        sep = ", " if i else ""
        entry = fmt.render_entries([o], i + 1)
        start = pos + len(sep.encode())
        end = start + len(entry.encode())
        desc = [
            (start + len(entry[:s].encode()), start + len(entry[:e].encode())) for s, e in fmt.desc_value_spans(entry)
        ]
        spans.append((start, end, desc))
        pieces.append(sep + entry)
        pos = end
    return "".join(pieces) + close, spans


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def build_clean_targets(
    prompt_ids: Sequence[int],
    parsed: ParsedRollout,
    duplicates: dict[int, int],
    kept_matching: MatchResult,
    gt: Sequence[DetObject],
    vocab: VocabView,
    fmt: OutputFormat = COORDEXP,
    rollout_prompt_ids: Sequence[int] | None = None,
    cfg: CleanPrefixConfig | None = None,
    recovered: Collection[int] = (),
    dead: Collection[int] = (),
) -> Segment:
    cfg = cfg or CleanPrefixConfig()
    require_coord_tokens(vocab, fmt)
    if rollout_prompt_ids is not None:
        check_prompt_ids(prompt_ids, rollout_prompt_ids)
    if len(prompt_ids) < 1:
        raise TargetError("prompt_ids is empty")
    objs = [p.obj for p in parsed.objects]
    if any(not 0 <= d < len(objs) or not 0 <= k < len(objs) for d, k in duplicates.items()):
        raise TargetError("duplicate index outside the parsed objects")
    dead = set(dead)
    if any(not 0 <= d < len(objs) or d in duplicates for d in dead):
        raise TargetError("a dead anchor index outside the parsed objects or also a duplicate")
    kept_idx = [i for i in range(len(objs)) if i not in duplicates and i not in dead]
    n_kept, n_gt = len(kept_idx), len(gt)
    for p, g, _ in kept_matching.pairs:
        if not (0 <= p < n_kept and 0 <= g < n_gt):
            raise TargetError(f"match pair ({p}, {g}) outside {n_kept} kept predictions x {n_gt} ground truths")
    gt_of = kept_matching.gt_of_pred()

    # The entries, in order: kept objects (answer order), then the missed ground truth.
    parts_spec: list[tuple[DetObject, str, tuple[int, ...] | None, bool, float]] = []
    for j, i in enumerate(kept_idx):
        o = objs[i]
        matched = gt_of.get(j)
        if matched is None:
            parts_spec.append((o, "kept", None, False, 1.0))
            continue
        target = gt[matched]
        same_shape = o.kind == target.kind and len(o.bins) == len(target.bins)
        parts_spec.append((o, "kept", target.bins if same_shape and fmt.coord_tokens else None, False, 1.0))
    recovered = set(recovered)
    for g in kept_matching.false_negatives:
        w = cfg.recovered_weight if g in recovered else 1.0
        parts_spec.append((gt[g], "fn", gt[g].bins if fmt.coord_tokens else None, cfg.supervise_fn_desc, w))

    opener = container_brackets(fmt.container)[0]
    body, spans = _body(fmt, [s[0] for s in parts_spec])
    head_ids = list(vocab.encode(opener))
    body_ids = list(vocab.encode(body))
    response = head_ids + body_ids + [vocab.eos_id]
    parts = [
        _Part(o, s, e, tuple(d), kind, bins, sup, w)
        for (o, kind, bins, sup, w), (s, e, d) in zip(parts_spec, spans, strict=True)
    ]
    kept_end = parts[n_kept - 1].end if n_kept else 0  # body bytes up to here are the model's own objects
    close_start = len(body.encode()) - len(container_brackets(fmt.container)[1].encode())

    prompt_len = len(prompt_ids)
    labels: list[int] = [IGNORE_INDEX] * prompt_len
    weights: list[float] = [0.0] * prompt_len
    coord_pos: list[int] = []
    coord_bins: list[int] = []
    coord_w: list[float] = []
    box_pos: list[tuple[int, ...]] = []
    box_tgt: list[tuple[int, ...]] = []
    box_w: list[float] = []

    def label(tok: int, w: float) -> None:
        labels.append(tok if w > 0 else IGNORE_INDEX)
        weights.append(w if w > 0 else 0.0)

    for t in head_ids:  # the opener: structure of the model's own answer
        label(t, cfg.structure_ce)
    base = prompt_len + len(head_ids)
    part_i, coord_k = 0, 0
    part_coords: dict[int, list[int]] = {}
    for i, (t, (bs, be)) in enumerate(zip(body_ids, _byte_spans(body_ids, vocab), strict=True)):
        while part_i < len(parts) and bs >= parts[part_i].end:
            if coord_k != len(parts[part_i].obj.bins if fmt.coord_tokens else ()):
                raise TargetError("body tokenization lost coord tokens of an entry")
            part_i, coord_k = part_i + 1, 0
        part = parts[part_i] if part_i < len(parts) and bs >= parts[part_i].start else None
        if t in vocab.coord_bin_of:
            if part is None or coord_k >= len(part.obj.bins) or vocab.coord_bin_of[t] != part.obj.bins[coord_k]:
                raise TargetError("body tokenization does not reproduce the entries' coord tokens")
            if part.target_bins is not None:
                coord_pos.append(base + i)
                coord_bins.append(part.target_bins[coord_k])
                coord_w.append(part.weight)
                part_coords.setdefault(part_i, []).append(base + i)
            coord_k += 1
            label(t, 0.0)
            continue
        if part is not None and any(bs < de and ds < be for ds, de in part.desc_spans):
            if part.kind == "kept":  # the model's own label, as prefix structure (the reference's code)
                w = cfg.structure_ce if cfg.prefix_labels else 0.0
            else:
                w = part.weight if part.desc_supervised else 0.0
        elif part is not None:
            w = cfg.structure_ce if part.kind == "kept" else 1.0
        else:  # a separator: between the model's own objects it is structure, after them the tail's
            w = cfg.structure_ce if be <= kept_end else 1.0
        # The closing bracket is always supervised, also inside a token it shares with the last entry (`}}`).
        label(t, max(w, 1.0) if be > close_start else w)
    if part_i < len(parts) and coord_k != len(parts[part_i].obj.bins if fmt.coord_tokens else ()):
        raise TargetError("body tokenization lost coord tokens of the last entry")
    label(vocab.eos_id, 1.0)  # end of turn: always supervised

    if cfg.geometry:
        for j, positions in part_coords.items():
            part = parts[j]
            if part.obj.kind == "bbox_2d" and len(positions) == 4 and part.target_bins is not None:
                box_pos.append(tuple(positions))
                box_tgt.append(tuple(part.target_bins))
                box_w.append(part.weight)

    # Unlikelihood: each duplicate put back at its place in the answer; the first token where that answer
    # parts from Y_train is the token that started the repeat.
    ul_pos: list[int] = []
    ul_tok: list[int] = []
    seen: set[tuple[int, int]] = set()
    if cfg.unlikelihood and duplicates:
        written = [s[0] for s in parts_spec]
        for d in sorted(duplicates):
            place = sum(1 for i in kept_idx if i < d)
            alt, _ = _body(fmt, written[:place] + [objs[d]] + written[place:])
            alt_ids = head_ids + list(vocab.encode(alt))
            at = _common_prefix(alt_ids, response)
            # A burst of the same duplicate at one place is one term (same position, same token).
            if at < len(alt_ids) and at < len(response) and (prompt_len + at, alt_ids[at]) not in seen:
                seen.add((prompt_len + at, alt_ids[at]))
                ul_pos.append(prompt_len + at)
                ul_tok.append(alt_ids[at])

    all_ones = all(w in (0.0, 1.0) for w in weights) and all(w == 1.0 for w in coord_w)
    order = sorted(range(len(coord_pos)), key=coord_pos.__getitem__)
    n_matched = len(kept_matching.pairs)
    return Segment(
        input_ids=tuple(int(t) for t in prompt_ids) + tuple(response),
        labels=tuple(labels),
        coord_positions=tuple(coord_pos[i] for i in order),
        coord_bins=tuple(coord_bins[i] for i in order),
        prompt_len=prompt_len,
        prefix_len=len(head_ids) + sum(1 for _, be in _byte_spans(body_ids, vocab) if be <= kept_end),
        meta={
            "n_pred": len(objs),
            "n_gt": n_gt,
            "n_matched": n_matched,
            "n_fn": len(kept_matching.false_negatives),
            "n_fp": len(kept_matching.false_positives),
            "n_dropped": parsed.n_dropped,
            "n_duplicates": len(duplicates),
            "n_dead": len(dead),
            "n_recovered": sum(1 for g in kept_matching.false_negatives if g in recovered),
            "truncated": parsed.truncated,
            "fallback": n_kept == 0,
        },
        ce_weights=None if all_ones else tuple(weights),
        coord_weights=None if all_ones else tuple(coord_w[i] for i in order),
        ul_positions=tuple(ul_pos),
        ul_tokens=tuple(ul_tok),
        box_positions=tuple(box_pos),
        box_bins=tuple(box_tgt),
        box_weights=tuple(box_w),
    )
