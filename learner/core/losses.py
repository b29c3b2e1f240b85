"""Loss of a packed row: masked token cross-entropy + coordinate loss (DESIGN §3.6).

Public API
- `LossWeights(ce=1.0, soft_ce=1.0, w1=1.0, gate=1.0, sigma=2.0)`.
- `compute_loss(logits, row, coord_token_ids, weights) -> LossOutput(loss, parts)`.
  `logits` is [1, L, V] or [L, V] for the row; positions in the row index *target* tokens, so
  the loss reads logits at position - 1 (a segment's first token is never a target, so nothing
  crosses a segment boundary). `parts` holds detached per-term means and the counts.
- `loss_sums(logits, row, coord_token_ids, sigma) -> LossSums`: the same terms as sums with grad;
  `(sums_a + sums_b).finish(weights)` pools several rows (gradient accumulation, unpacked runs).
  `coord_token_ids` may be empty (a format without coord tokens, e.g. qwen_json): rows then carry
  no coord positions, the coordinate terms are exact zeros in the graph and all gradient is CE's;
  coord positions with no coord token ids are an error.
- `coord_loss_terms(coord_logits, full_logits, target_bins, sigma)`: per-position soft CE, W1, gate.

loss = ce * mean CE over labelled tokens + mean over coord positions of
       (soft_ce * CE(Gaussian(target, sigma) || softmax(coord logits))
        + w1 * sum_k |CDF_p(k) - CDF_q(k)| / 1000
        + gate * (logsumexp(all logits) - logsumexp(coord logits))).
Means are over all positions of the row (token-level, not per segment), which makes a packed
row's loss exactly the loss of its segments run one by one with the same pooling.
The Gaussian is truncated to the grid and renormalised: its minimiser over all distributions is
the Gaussian itself (mode at the target), but within ~2 sigma of a border a one-hot prediction is
pulled up to one bin inwards (the truncated target's mean/median sits inside).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from learner.core.codec import NUM_BINS
from learner.core.packing import PackedRow
from learner.core.targets import IGNORE_INDEX


@dataclass(frozen=True)
class LossWeights:
    ce: float = 1.0
    soft_ce: float = 1.0
    w1: float = 1.0
    gate: float = 1.0
    sigma: float = 2.0

    def __post_init__(self) -> None:
        if min(self.ce, self.soft_ce, self.w1, self.gate) < 0:
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


@dataclass
class LossSums:
    """Un-normalised sums (with grad) and counts of one row; add rows, then `finish`."""

    ce_sum: torch.Tensor
    ce_count: int
    soft_ce_sum: torch.Tensor
    w1_sum: torch.Tensor
    gate_sum: torch.Tensor
    coord_count: int

    def __add__(self, other: LossSums) -> LossSums:
        return LossSums(
            self.ce_sum + other.ce_sum,
            self.ce_count + other.ce_count,
            self.soft_ce_sum + other.soft_ce_sum,
            self.w1_sum + other.w1_sum,
            self.gate_sum + other.gate_sum,
            self.coord_count + other.coord_count,
        )

    def finish(self, weights: LossWeights | None = None) -> LossOutput:
        """Token-level means over everything summed so far, weighted into one loss."""
        w = weights or LossWeights()
        nc, nk = max(self.ce_count, 1), max(self.coord_count, 1)
        ce = self.ce_sum / nc
        soft, w1, gate = self.soft_ce_sum / nk, self.w1_sum / nk, self.gate_sum / nk
        coord = w.soft_ce * soft + w.w1 * w1 + w.gate * gate
        loss = w.ce * ce + coord
        parts = {
            "ce": ce.detach(),
            "soft_ce": soft.detach(),
            "w1": w1.detach(),
            "gate": gate.detach(),
            "coord": coord.detach(),
            "ce_count": torch.tensor(self.ce_count),
            "coord_count": torch.tensor(self.coord_count),
        }
        return LossOutput(loss, parts)


def loss_sums(
    logits: torch.Tensor, row: PackedRow, coord_token_ids: Sequence[int] | torch.Tensor, sigma: float = 2.0
) -> LossSums:
    """Per-row sums of every loss term; see the module docstring for shapes."""
    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError(f"a packed row has batch size 1, got logits of shape {tuple(logits.shape)}")
        logits = logits[0]
    if logits.shape[0] != row.length:
        raise ValueError(f"logits cover {logits.shape[0]} positions but the row has {row.length}")
    device = logits.device
    labels = row.labels[0].to(device)
    if row.ce_positions is not None:
        ce_pos = row.ce_positions.to(device)
    else:  # a row built by hand
        ce_pos = torch.nonzero(labels != IGNORE_INDEX).flatten()
    # A zero that stays in the graph (backward works on rows without targets), NaN-free for inf logits.
    zero = 0.0 * logits.reshape(-1)[0].clamp(-1.0, 1.0)
    ce_sum = zero
    if ce_pos.numel():
        ce_sum = F.cross_entropy(logits[ce_pos - 1].float(), labels[ce_pos], reduction="sum")
    cpos = row.coord_positions.to(device)
    if cpos.numel():
        ids = torch.as_tensor(coord_token_ids, dtype=torch.long, device=device)
        if ids.numel() != NUM_BINS:
            raise ValueError(
                f"the row has {cpos.numel()} coord position(s) but {ids.numel()} coord token ids were given "
                f"(need {NUM_BINS}): a format without coord tokens must not produce coord targets")
        full = logits[cpos - 1]
        soft_ce, w1, gate = coord_loss_terms(full[:, ids], full, row.coord_bins.to(device), sigma)
        soft_sum, w1_sum, gate_sum = soft_ce.sum(), w1.sum(), gate.sum()
    else:
        soft_sum = w1_sum = gate_sum = zero
    return LossSums(ce_sum, int(ce_pos.numel()), soft_sum, w1_sum, gate_sum, int(cpos.numel()))


def compute_loss(
    logits: torch.Tensor,
    row: PackedRow,
    coord_token_ids: Sequence[int] | torch.Tensor,
    weights: LossWeights | None = None,
) -> LossOutput:
    """Loss of one packed row (token-level means over the row)."""
    w = weights or LossWeights()
    return loss_sums(logits, row, coord_token_ids, w.sigma).finish(w)
