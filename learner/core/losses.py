"""Loss of a packed row: masked token cross-entropy + coordinate loss (DESIGN §3.6).

Public API
- `LossWeights(ce=1.0, soft_ce=1.0, w1=1.0, gate=1.0, sigma=2.0)`.
- `compute_loss(logits, row, coord_token_ids, weights) -> LossOutput(loss, parts)`.
  `logits` is [1, L, V] or [L, V] for the row, or a `learner.core.head.RowHead` (the row's hidden states and the
  output head: logits made only at target positions, a chunk at a time, recomputed in backward); positions in
  the row index *target* tokens, so the loss reads logits at position - 1 (a segment's first token is never a
  target, so nothing crosses a segment boundary). `parts` holds detached per-term means and the counts.
- `loss_sums(logits, row, coord_token_ids, sigma) -> LossSums`: the same terms as sums with grad;
  `(sums_a + sums_b).finish(weights)` pools several rows (gradient accumulation, unpacked runs).
  `coord_token_ids` may be empty (a format without coord tokens, e.g. qwen_json): rows then carry
  no coord positions, the coordinate terms are exact zeros in the graph and all gradient is CE's;
  coord positions with no coord token ids are an error.
- `coord_loss_terms(coord_logits, full_logits, target_bins, sigma)`: per-position soft CE, W1, gate.
- `row_totals(row, weighted) -> (ce, coord, box, ul)`: a row's share of a step's denominators: counts of
  supervised positions, boxes and unlikelihood terms, or with `weighted` the sums of their weights (summed over
  a step's rows and ranks, then `LossSums.normalised_by`).

loss = ce * mean CE over labelled tokens + mean over coord positions of
       (soft_ce * CE(Gaussian(target, sigma) || softmax(coord logits))
        + w1 * sum_k |CDF_p(k) - CDF_q(k)| / 1000
        + gate * (logsumexp(all logits) - logsumexp(coord logits))).
Means are over all positions of the row (token-level, not per segment), which makes a packed
row's loss exactly the loss of its segments run one by one with the same pooling. A position's weight
(`ce_weights`, `coord_weights`, `box_weights`) multiplies its term; the mean divides by the number of
positions, or by the sum of the weights (`LossWeights.weighted_mean`, the second generation's default).
The Gaussian is truncated to the grid and renormalised: its minimiser over all distributions is
the Gaussian itself (mode at the target), but within ~2 sigma of a border a one-hot prediction is
pulled up to one bin inwards (the truncated target's mean/median sits inside).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from learner.core.codec import NUM_BINS
from learner.core.head import RowHead, logits_rows, squeeze_row, token_ce, zero_of
from learner.core.packing import PackedRow
from learner.core.targets import IGNORE_INDEX


@dataclass(frozen=True)
class LossWeights:
    ce: float = 1.0
    soft_ce: float = 1.0
    w1: float = 1.0
    gate: float = 1.0
    sigma: float = 2.0
    # The second-generation recipe's terms (0 = off, the first generation):
    coord_ce: float = 0.0  # hard cross-entropy of the target bin's token over the whole vocabulary
    smooth_l1: float = 0.0  # box terms on the coordinates' expected values (`box_terms`)
    ciou: float = 0.0
    unlikelihood: float = 0.0  # -log(1 - p(token)) at each duplicate's first diverging token
    # How a term is averaged: False divides sum(w * loss) by the number of positions (boxes), True by sum(w), the
    # reference's weighted mean (`row_totals`); the unlikelihood term is a plain mean either way.
    weighted_mean: bool = False

    def __post_init__(self) -> None:
        if (
            min(self.ce, self.soft_ce, self.w1, self.gate, self.coord_ce, self.smooth_l1, self.ciou, self.unlikelihood)
            < 0
        ):
            raise ValueError("loss weights must be >= 0")
        if self.sigma <= 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma}")


@dataclass
class LossOutput:
    loss: torch.Tensor
    parts: dict[str, torch.Tensor]


def gaussian_targets(bins: torch.Tensor, sigma: float, num_bins: int = NUM_BINS) -> torch.Tensor:
    """[n, num_bins] Gaussian over bins centred on each target, normalised on the grid."""
    grid = torch.arange(num_bins, device=bins.device, dtype=torch.float32)
    logq = -0.5 * ((grid[None, :] - bins[:, None].float()) / sigma) ** 2
    return torch.softmax(logq, dim=-1)


def coord_loss_terms(
    coord_logits: torch.Tensor, full_logits: torch.Tensor, target_bins: torch.Tensor, sigma: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position (soft_ce, w1, gate), each of shape [n]; computed in fp32."""
    coord_logits = coord_logits.float()
    num_bins = coord_logits.shape[-1]
    q = gaussian_targets(target_bins, sigma, num_bins).to(coord_logits.dtype)
    logp = torch.log_softmax(coord_logits, dim=-1)
    # q underflows to 0 far from the target; 0 * -inf (a masked logit) must count as 0, not NaN.
    soft_ce = -torch.where(q > 0, q * logp, torch.zeros_like(logp)).sum(-1)
    cdf_gap = torch.cumsum(logp.exp() - q, dim=-1)
    w1 = cdf_gap.abs().sum(-1) / num_bins
    gate = torch.logsumexp(full_logits.float(), dim=-1) - torch.logsumexp(coord_logits, dim=-1)
    return soft_ce, w1, gate


def expected_coord(coord_logits: torch.Tensor) -> torch.Tensor:
    """[n] expected bin of each coordinate distribution, in [0, 1] (sum_k p(k) k / (bins - 1))."""
    n_bins = coord_logits.shape[-1]
    grid = torch.arange(n_bins, device=coord_logits.device, dtype=torch.float32) / (n_bins - 1)
    return (torch.softmax(coord_logits.float(), dim=-1) * grid).sum(-1)


def box_terms(pred: torch.Tensor, target: torch.Tensor, eps: float = 1e-7) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-box (SmoothL1 mean over the four coordinates, 1 - CIoU) of [b, 4] (x1, y1, x2, y2) boxes in [0, 1].
    The predicted corners are put in order first (a model may write x2 < x1 early on)."""
    p = torch.stack(
        [
            torch.minimum(pred[:, 0], pred[:, 2]),
            torch.minimum(pred[:, 1], pred[:, 3]),
            torch.maximum(pred[:, 0], pred[:, 2]),
            torch.maximum(pred[:, 1], pred[:, 3]),
        ],
        dim=1,
    )
    t = target.float()
    l1 = F.smooth_l1_loss(p, t, beta=1.0, reduction="none").mean(-1)
    pw, ph = (p[:, 2] - p[:, 0]).clamp_min(eps), (p[:, 3] - p[:, 1]).clamp_min(eps)
    tw, th = (t[:, 2] - t[:, 0]).clamp_min(eps), (t[:, 3] - t[:, 1]).clamp_min(eps)
    iw = (torch.minimum(p[:, 2], t[:, 2]) - torch.maximum(p[:, 0], t[:, 0])).clamp_min(0)
    ih = (torch.minimum(p[:, 3], t[:, 3]) - torch.maximum(p[:, 1], t[:, 1])).clamp_min(0)
    inter = iw * ih
    union = pw * ph + tw * th - inter + eps
    iou = inter / union
    cw = torch.maximum(p[:, 2], t[:, 2]) - torch.minimum(p[:, 0], t[:, 0])
    ch = torch.maximum(p[:, 3], t[:, 3]) - torch.minimum(p[:, 1], t[:, 1])
    diag = cw**2 + ch**2 + eps
    rho = ((p[:, 0] + p[:, 2] - t[:, 0] - t[:, 2]) ** 2 + (p[:, 1] + p[:, 3] - t[:, 1] - t[:, 3]) ** 2) / 4
    v = (4 / math.pi**2) * (torch.atan(tw / th) - torch.atan(pw / ph)) ** 2
    alpha = v / (1 - iou + v + eps)
    ciou = iou - rho / diag - alpha * v
    return l1, 1 - ciou


_SUM_FIELDS = ("ce_sum", "soft_ce_sum", "w1_sum", "gate_sum", "coord_ce_sum", "l1_sum", "ciou_sum", "ul_sum")
_COUNT_FIELDS = ("ce_count", "coord_count", "box_count", "ul_count")


@dataclass
class LossSums:
    """Un-normalised sums (with grad) and counts of one row; add rows, then `finish`."""

    ce_sum: torch.Tensor
    ce_count: float  # the denominators: counts, or sums of weights (`row_totals`)
    soft_ce_sum: torch.Tensor
    w1_sum: torch.Tensor
    gate_sum: torch.Tensor
    coord_count: float
    coord_ce_sum: torch.Tensor | float = 0.0
    l1_sum: torch.Tensor | float = 0.0
    ciou_sum: torch.Tensor | float = 0.0
    box_count: float = 0
    ul_sum: torch.Tensor | float = 0.0
    ul_count: float = 0

    def __add__(self, other: LossSums) -> LossSums:
        kw = {f: getattr(self, f) + getattr(other, f) for f in (*_SUM_FIELDS, *_COUNT_FIELDS)}
        return LossSums(**kw)

    def normalised_by(self, ce: float, coord: float, box: float, ul: float) -> LossSums:
        """These sums over other counts (a step's totals over all rows and ranks: summing the rows' losses
        then gives the pooled mean)."""
        kw = {f: getattr(self, f) for f in _SUM_FIELDS}
        return LossSums(**kw, ce_count=ce, coord_count=coord, box_count=box, ul_count=ul)

    def finish(self, weights: LossWeights | None = None) -> LossOutput:
        """Token-level means over everything summed so far, weighted into one loss."""
        w = weights or LossWeights()
        # A denominator of 0 has no term to divide (its sum is 0 too); weighted ones may be below 1.
        nc, nk, nb, nu = (n if n > 0 else 1 for n in (self.ce_count, self.coord_count, self.box_count, self.ul_count))
        ce = self.ce_sum / nc
        soft, w1, gate, coord_ce = self.soft_ce_sum / nk, self.w1_sum / nk, self.gate_sum / nk, self.coord_ce_sum / nk
        l1, ciou, ul = self.l1_sum / nb, self.ciou_sum / nb, self.ul_sum / nu
        coord = w.soft_ce * soft + w.w1 * w1 + w.gate * gate + w.coord_ce * coord_ce
        geo = w.smooth_l1 * l1 + w.ciou * ciou
        loss = w.ce * ce + coord + geo + w.unlikelihood * ul
        parts = {
            "ce": ce.detach(),
            "soft_ce": soft.detach(),
            "w1": w1.detach(),
            "gate": gate.detach(),
            "coord": coord.detach(),
            "geo": _detached(geo, ce),
            "ul": _detached(ul, ce),
            "ce_count": torch.tensor(self.ce_count),
            "coord_count": torch.tensor(self.coord_count),
        }
        return LossOutput(loss, parts)


def _detached(x: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    return x.detach() if isinstance(x, torch.Tensor) else torch.zeros((), device=like.device) + x


def _coord_terms(ids: torch.Tensor, sigma: float, boxes: bool) -> Callable[..., tuple[torch.Tensor, ...]]:
    """Per coordinate position: (soft_ce, w1, gate, coord_ce[, expected value when the row has boxes])."""

    def terms(full: torch.Tensor, bins: torch.Tensor) -> tuple[torch.Tensor, ...]:
        coord_logits = full[:, ids]
        soft_ce, w1, gate = coord_loss_terms(coord_logits, full, bins, sigma)
        # Hard CE over the whole vocabulary = gate (log of the mass off the coord tokens) + CE over the coord
        # logits: the whole-vocabulary logsumexp is the gate's, not computed a second time.
        coord_ce = gate + F.cross_entropy(coord_logits.float(), bins, reduction="none")
        return (soft_ce, w1, gate, coord_ce, expected_coord(coord_logits)) if boxes else (soft_ce, w1, gate, coord_ce)

    return terms


def _ul_terms(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return (logp.gather(-1, tokens[:, None]).squeeze(-1).exp(),)


def loss_sums(
    logits: torch.Tensor | RowHead,
    row: PackedRow,
    coord_token_ids: Sequence[int] | torch.Tensor,
    sigma: float = 2.0,
    weighted: bool = False,
) -> LossSums:
    """Per-row sums of every loss term; see the module docstring for shapes. `logits` may be a `RowHead` (the row's
    hidden states and the head, `spec.training.loss.logits: chunked`): the same terms, the logits made a chunk of
    target positions at a time (learner/core/head.py)."""
    logits = squeeze_row(logits, row.length)
    device = logits.hidden.device if isinstance(logits, RowHead) else logits.device
    labels = row.labels[0].to(device)
    if row.ce_positions is not None:
        ce_pos = row.ce_positions.to(device)
    else:  # a row built by hand
        ce_pos = torch.nonzero(labels != IGNORE_INDEX).flatten()
    zero = zero_of(logits)
    ce_sum = zero
    if ce_pos.numel():
        per_token = token_ce(logits, ce_pos - 1, labels[ce_pos])  # fused: liger-kernel's kernel (learner/core/fused.py)
        if row.ce_weights is not None:
            per_token = per_token * row.ce_weights.to(device)[ce_pos]
        ce_sum = per_token.sum()
    cpos = row.coord_positions.to(device)
    soft_sum = w1_sum = gate_sum = coord_ce_sum = l1_sum = ciou_sum = zero
    n_boxes = row.n_boxes
    if cpos.numel():
        ids = torch.as_tensor(coord_token_ids, dtype=torch.long, device=device)
        if ids.numel() != NUM_BINS:
            raise ValueError(
                f"the row has {cpos.numel()} coord position(s) but {ids.numel()} coord token ids were given "
                f"(need {NUM_BINS}): a format without coord tokens must not produce coord targets"
            )
        bins = row.coord_bins.to(device)
        soft_ce, w1, gate, coord_ce, *value = logits_rows(
            logits, cpos - 1, _coord_terms(ids, sigma, bool(n_boxes)), bins
        )
        if row.coord_weights is not None:
            cw = row.coord_weights.to(device)
            soft_ce, w1, gate, coord_ce = soft_ce * cw, w1 * cw, gate * cw, coord_ce * cw
        soft_sum, w1_sum, gate_sum, coord_ce_sum = soft_ce.sum(), w1.sum(), gate.sum(), coord_ce.sum()
        if n_boxes:
            assert row.box_coords is not None and row.box_bins is not None and row.box_weights is not None, (
                "n_boxes > 0: the row was packed with its boxes' coords, bins and weights"
            )
            l1, ciou = box_terms(value[0][row.box_coords.to(device)], row.box_bins.to(device).float() / (NUM_BINS - 1))
            bw = row.box_weights.to(device)
            l1_sum, ciou_sum = (l1 * bw).sum(), (ciou * bw).sum()
    ul_sum = zero
    if row.n_unlikelihood:
        assert row.ul_positions is not None and row.ul_tokens is not None, "packed together (n_unlikelihood > 0)"
        upos = row.ul_positions.to(device)
        (p,) = logits_rows(logits, upos - 1, _ul_terms, row.ul_tokens.to(device))
        ul_sum = -torch.log((1 - p).clamp_min(1e-6)).sum()
    # Weighted denominators read the weights on the host: the training loop computes them once per step, before the
    # rows go to the device (`row_totals`), and calls this with `weighted` False.
    ce_n, coord_n, box_n, ul_n = (
        row_totals(row, True) if weighted else (int(ce_pos.numel()), int(cpos.numel()), n_boxes, row.n_unlikelihood)
    )
    return LossSums(
        ce_sum, ce_n, soft_sum, w1_sum, gate_sum, coord_n, coord_ce_sum, l1_sum, ciou_sum, box_n, ul_sum, ul_n
    )


def row_totals(row: PackedRow, weighted: bool = False) -> tuple[float, float, float, float]:
    """The row's denominators of (CE, coordinate terms, box terms, unlikelihood): positions, or with `weighted` the
    sums of their weights (a row without weights has weight 1 everywhere, so both agree)."""
    labels = row.labels[0]
    ce_pos = row.ce_positions if row.ce_positions is not None else torch.nonzero(labels != IGNORE_INDEX).flatten()
    ce: float = int(ce_pos.numel())
    coord: float = int(row.coord_positions.numel())
    box: float = row.n_boxes
    if weighted:
        if row.ce_weights is not None:
            ce = float(row.ce_weights[ce_pos.to(row.ce_weights.device)].sum())
        if row.coord_weights is not None:
            coord = float(row.coord_weights.sum())
        if row.n_boxes and row.box_weights is not None:
            box = float(row.box_weights.sum())
    return ce, coord, box, row.n_unlikelihood


def compute_loss(
    logits: torch.Tensor | RowHead,
    row: PackedRow,
    coord_token_ids: Sequence[int] | torch.Tensor,
    weights: LossWeights | None = None,
) -> LossOutput:
    """Loss of one packed row (token-level means over the row)."""
    w = weights or LossWeights()
    return loss_sums(logits, row, coord_token_ids, w.sigma, w.weighted_mean).finish(w)
