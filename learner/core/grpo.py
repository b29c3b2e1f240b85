"""The GRPO objective on packed rows: group-normalised advantages and the clipped surrogate.

Public API
- `GrpoConfig(clip_eps=0.2, clip_eps_high=None, kl_coef=0.0, scale_rewards=True, loss_norm="token",
  temperature=1.0, correction="none", correction_low=None, correction_high=None)`; `.eps_high`
  (clip_eps_high, or clip_eps when unset); `.correction_bounds` (the thresholds in force).
- `group_advantages(rewards, group_sizes=None, *, scale=True, eps=1e-4) -> Tensor[N]`: per-prompt
  mean subtracted, divided by (std + eps) when `scale`; a group whose rewards are all equal (one
  sample included) gets exact zeros.
- `grpo_segment(prompt_ids, completion_ids, old_logprobs, advantage, completion_mask=None, meta=None)
  -> Segment`: one sample as a segment (prompt unlabelled, completion labelled) carrying its
  sampling log-probs and advantage in `meta`, so they travel with it through the `Packer`, which
  reorders segments.
- `grpo_tokens(row) -> GrpoTokens`: the row's per-token old log-probs, advantages and 1/length, in
  the order of the row's labelled positions; build it from the CPU row (as the packer returns it),
  then `.to(device)`.
- `completion_logprobs(logits, row, temperature=1.0) -> Tensor[n]`: log-probs of the row's labelled
  tokens (logits read at position - 1, as in `losses`), fp32, with grad. Also what a reference
  forward (adapters disabled, `no_grad`) gives as `ref_logprobs`.
- `grpo_sums(logprobs, tokens, cfg, ref_logprobs=None) -> GrpoSums`: per-token terms summed, with
  grad; `(a + b).finish(cfg)` pools rows, `finish(cfg, total_tokens=, total_seqs=)` normalises one
  row by totals known before the forward (backward per row, gradient accumulation, several ranks).
- `grpo_row_sums(logits, row, cfg, ref_logprobs=None, tokens=None)` and
  `grpo_loss(logits, row, cfg, ref_logprobs=None, tokens=None) -> GrpoOutput(loss, metrics)`.

Per completion token t of a sequence with advantage A (DeepSeekMath GRPO, PPO's clip):
    r_t    = exp(logp_t - old_logp_t)
    loss_t = -min(r_t * A, clip(r_t, 1 - clip_eps, 1 + eps_high) * A)
             + kl_coef * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)         (k3 estimator)
loss_norm "token": sum of loss_t over every completion token pooled / their number (each token
weighs the same, DAPO / Dr.GRPO: a long answer is not diluted); "sequence": mean over each
sequence's tokens, then mean over sequences (the original GRPO: each answer weighs the same, so a
long wrong answer's tokens are each penalised less than a short one's). Both are sums of per-token
terms with weights known before the forward (1 or 1/len(sequence)), and a segment never spans two
rows, so a packed row's loss is exactly the loss of its segments run one by one and pooled.

Train/inference mismatch (`correction`). `old_logp` is the behaviour policy's: what the server that
sampled the token reported (its kernels, its precision, and with rollouts ahead or in flight an
older weight version). With `correction: none` (the default) the ratio above is taken against it
directly (verl's "bypass" mode): the PPO clip is the only guard. Any other correction decouples
the two (the three-policy PPO of verl's rollout correction, AReaL's decoupled PPO): the trust
region is taken against the learner's own policy at the step's start, whose log-probs are the
forward's own, detached (rmsft takes one optimizer step per batch, so that policy is the one being
differentiated: prox_t = logp_t.detach(), r_t = exp(logp_t - prox_t) = 1 in value), and the
mismatch is corrected by an importance weight w_t, no gradient through it, of
rho_t = exp(prox_t - old_logp_t) = pi_learner / pi_behaviour:
    loss_t = -w_t * min(r_t * A, clip(r_t, ...) * A)   (+ the KL term as above)
    tis     w_t = min(rho_t, C)                    token-level truncated IS (Yao et al. 2025, "Your
            efficient RL framework secretly brings you off-policy RL training"; verl rollout_is:
            token, truncated). C = correction_high, default 2.
    mis     w_t = rho(y) if lo <= rho(y) <= C else 0, rho(y) = prod_t rho_t over the answer's trained
            tokens: sequence-level masked IS (Liu, Li et al. 2025, "When Speed Kills Stability"; verl
            seq-mis: a whole answer whose ratio leaves the band is dropped). C = correction_high,
            default 2; lo = correction_low, default 0 (no lower bound).
    icepop  w_t = rho_t if lo <= rho_t <= C else 0: token-level masking of both tails (Ling team 2025,
            IcePop, Ring-1T: M(k) = k inside [alpha, beta]). lo default 0.5, C default 5.
Whatever the correction, `mismatch_kl` reports the k3 estimate of KL(pi_behaviour || pi_learner) per
token: exp(d) - d - 1 with d = prox_t - old_logp_t, whose mean over tokens sampled from the
behaviour policy is that KL (0 when the servers and the learner agree).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from learner.core.head import RowHead, squeeze_row, token_ce, zero_of
from learner.core.packing import PackedRow
from learner.core.targets import IGNORE_INDEX, Segment

# Keys of `Segment.meta` / `SegmentInfo.meta` that `grpo_segment` writes and `grpo_tokens` reads.
META_OLD_LOGPROBS = "grpo_old_logprobs"
META_ADVANTAGE = "grpo_advantage"

LossNorm = Literal["token", "sequence"]
Correction = Literal["none", "tis", "mis", "icepop"]
CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis", "icepop")
# (low, high) thresholds of each correction when unset (module doc: the peers' published defaults).
CORRECTION_DEFAULTS: dict[str, tuple[float | None, float | None]] = {
    "none": (None, None),
    "tis": (None, 2.0),
    "mis": (0.0, 2.0),
    "icepop": (0.5, 5.0),
}


class GrpoInputError(ValueError):
    """Rewards, log-probs or segments that do not fit together (names what is wrong and where)."""


@dataclass(frozen=True)
class GrpoConfig:
    """Hyper-parameters of the GRPO loss.

    clip_eps / clip_eps_high: the trust region of the importance ratio, [1 - clip_eps, 1 + eps_high].
        A separate upper bound (DAPO's "clip-higher", e.g. 0.28) lets low-probability tokens with a
        positive advantage grow faster, which keeps exploration (entropy) from collapsing.
    kl_coef: weight of the k3 KL estimate to the reference policy; 0 (the default) drops the term and
        needs no reference forward (DAPO and Dr.GRPO find it unnecessary for verifiable rewards).
    scale_rewards: divide each group's centred rewards by their std (DeepSeekMath GRPO, the default).
        Dr.GRPO argues against it: it up-weights groups that are nearly all right or all wrong (small
        std: questions that are too easy or too hard), a difficulty bias; off, advantages are the
        plain centred rewards. The training loop passes it to `group_advantages`; the loss never reads it.
    loss_norm: "token" or "sequence", see the module docstring.
    temperature: the sampling temperature the old log-probs were taken at: the learner divides its
        logits by it so both sides of the ratio are the same distribution (the servers must then
        report log-probs of the temperature-scaled distribution).
    correction / correction_low / correction_high: the train/inference mismatch correction and its
        band (module doc); unset thresholds take `CORRECTION_DEFAULTS`. tis has no lower bound.
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    scale_rewards: bool = True
    loss_norm: LossNorm = "token"
    temperature: float = 1.0
    correction: Correction = "none"
    correction_low: float | None = None
    correction_high: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.clip_eps < 1.0:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0.0:
            raise ValueError(f"clip_eps_high must be > 0, got {self.clip_eps_high}")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.loss_norm not in ("token", "sequence"):
            raise ValueError(f"loss_norm must be 'token' or 'sequence', got {self.loss_norm!r}")
        if not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction must be one of {', '.join(CORRECTIONS)}, got {self.correction!r}")
        if self.correction == "none" and (self.correction_low is not None or self.correction_high is not None):
            raise ValueError("correction_low / correction_high need a correction (tis, mis or icepop)")
        if self.correction == "tis" and self.correction_low is not None:
            raise ValueError("correction tis truncates from above only: it takes correction_high, not correction_low")
        lo, hi = self.correction_bounds
        # The band must hold ratio 1 (server and learner agree): a correction that drops agreeing tokens is a typo.
        if lo is not None and not 0.0 <= lo < 1.0:
            raise ValueError(f"correction_low must be in [0, 1), got {lo}")
        if hi is not None and not hi > 1.0:
            raise ValueError(f"correction_high must be > 1, got {hi}")

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @property
    def correction_bounds(self) -> tuple[float | None, float | None]:
        """(low, high) of the correction in force: the given thresholds, else `CORRECTION_DEFAULTS`."""
        lo, hi = CORRECTION_DEFAULTS.get(self.correction, (None, None))
        return (
            lo if self.correction_low is None else self.correction_low,
            hi if self.correction_high is None else self.correction_high,
        )


# ---- advantages --------------------------------------------------------------------------------


def group_advantages(
    rewards: torch.Tensor | Sequence[float] | Sequence[Sequence[float]],
    group_sizes: Sequence[int] | int | None = None,
    *,
    scale: bool = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Advantage of every sample: its reward minus its group's mean, divided by (std + eps) when
    `scale`. A group is the samples of one prompt, consecutive in `rewards`.

    `rewards` is flat (with `group_sizes`: a list, or one int for equal groups) or a list of groups.
    The std is the unbiased one (as GRPO implementations compute it). A group whose rewards are all
    equal - a single sample included - carries no signal about which answer is better, so it gets
    exact zeros (not a rounding residue amplified by 1/eps, and never the NaN of a 1-sample std).
    Computed in float64, returned as float32 of shape [N]."""
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if not isinstance(rewards, torch.Tensor) and len(rewards) and isinstance(rewards[0], (list, tuple)):
        groups = [list(g) for g in rewards]  # type: ignore[arg-type]
        sizes = [len(g) for g in groups]
        if group_sizes is not None and list(_sizes(group_sizes, sum(sizes))) != sizes:
            raise GrpoInputError(f"group_sizes {group_sizes} disagree with the groups given (sizes {sizes})")
        flat = torch.tensor([r for g in groups for r in g], dtype=torch.float64)
    else:
        flat = torch.as_tensor(rewards, dtype=torch.float64).flatten().cpu()
        if group_sizes is None:
            raise GrpoInputError("flat rewards need group_sizes (one int per prompt, or the group size)")
        sizes = _sizes(group_sizes, flat.numel())
    if any(s < 1 for s in sizes):
        raise GrpoInputError(f"every group needs at least one sample, got sizes {sizes}")
    if sum(sizes) != flat.numel():
        raise GrpoInputError(f"group sizes sum to {sum(sizes)} but there are {flat.numel()} rewards")
    if not torch.isfinite(flat).all():
        bad = torch.nonzero(~torch.isfinite(flat)).flatten().tolist()
        raise GrpoInputError(f"rewards must be finite; non-finite at sample index(es) {bad[:10]}")
    if flat.numel() == 0:
        return torch.zeros(0, dtype=torch.float32)
    n = torch.tensor(sizes, dtype=torch.float64)
    gid = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    mean = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, gid, flat) / n
    centred = flat - mean[gid]
    lo = torch.full((len(sizes),), math.inf, dtype=torch.float64).scatter_reduce(0, gid, flat, "amin")
    hi = torch.full((len(sizes),), -math.inf, dtype=torch.float64).scatter_reduce(0, gid, flat, "amax")
    constant = (lo == hi)[gid]
    adv = centred
    if scale:
        sq = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, gid, centred * centred)
        std = torch.sqrt(sq / (n - 1).clamp(min=1.0))
        adv = centred / (std[gid] + eps)
    return torch.where(constant, torch.zeros_like(adv), adv).to(torch.float32)


def _sizes(group_sizes: Sequence[int] | int, total: int) -> list[int]:
    if isinstance(group_sizes, int):
        if group_sizes < 1 or total % group_sizes:
            raise GrpoInputError(f"{total} rewards do not split into groups of {group_sizes}")
        return [group_sizes] * (total // group_sizes)
    return [int(s) for s in group_sizes]


# ---- samples as segments -----------------------------------------------------------------------


def grpo_segment(
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    old_logprobs: Sequence[float],
    advantage: float,
    completion_mask: Sequence[bool] | None = None,
    meta: dict | None = None,
) -> Segment:
    """One sampled completion as a packable segment: the prompt unlabelled, each completion token
    its own label (trained unless `completion_mask` is False there, e.g. a truncated answer left out),
    its sampling log-probs (one per completion token, as the server reported them) and advantage in
    `meta`. A vision-language model's segment then gets its `vision` with `dataclasses.replace`."""
    prompt, completion = tuple(int(t) for t in prompt_ids), tuple(int(t) for t in completion_ids)
    if not prompt:
        raise GrpoInputError("a GRPO segment needs at least one prompt token (the first token has no logit)")
    if len(old_logprobs) != len(completion):
        raise GrpoInputError(
            f"{len(old_logprobs)} old log-probs for {len(completion)} completion tokens: the rollout must "
            "report one log-prob per sampled token"
        )
    mask = [True] * len(completion) if completion_mask is None else [bool(m) for m in completion_mask]
    if len(mask) != len(completion):
        raise GrpoInputError(f"completion_mask has {len(mask)} entries for {len(completion)} completion tokens")
    old = tuple(float(x) for x, keep in zip(old_logprobs, mask, strict=True) if keep)
    if not all(math.isfinite(x) and x <= 0.0 for x in old):
        raise GrpoInputError("old log-probs must be finite and <= 0 (log-probabilities of sampled tokens)")
    if not math.isfinite(float(advantage)):
        raise GrpoInputError(f"advantage must be finite, got {advantage}")
    trained = tuple(t if keep else IGNORE_INDEX for t, keep in zip(completion, mask, strict=True))
    labels = (IGNORE_INDEX,) * len(prompt) + trained
    info = dict(meta or {})
    info[META_OLD_LOGPROBS] = old
    info[META_ADVANTAGE] = float(advantage)
    return Segment(prompt + completion, labels, (), (), len(prompt), 0, info)


@dataclass
class GrpoTokens:
    """Per labelled token of a row, in row order: the sampling log-prob, the sequence's advantage and
    1 / (the sequence's labelled-token count): the sequence-mean weight. Counts are host ints, so a
    trainer knows every denominator before the forward, without reading the device."""

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    inv_seq_len: torch.Tensor
    n_tokens: int
    n_seqs: int
    # Which of the row's sequences (0 .. n_seqs - 1) each token belongs to: sequence-level corrections (mis).
    seq_index: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> GrpoTokens:
        return GrpoTokens(
            self.old_logprobs.to(device),
            self.advantages.to(device),
            self.inv_seq_len.to(device),
            self.n_tokens,
            self.n_seqs,
            None if self.seq_index is None else self.seq_index.to(device),
        )


def grpo_tokens(row: PackedRow) -> GrpoTokens:
    """Gather the per-token inputs of the loss from the row's segments (`grpo_segment`'s meta). Reads
    the labels on the host: call it on the row the packer returned, before moving it to a device."""
    labels = row.labels.reshape(-1).cpu()
    old: list[float] = []
    adv: list[float] = []
    inv: list[float] = []
    seq: list[int] = []
    n_seqs = 0
    for i, info in enumerate(row.segments):
        n = int((labels[info.offset : info.offset + info.length] != IGNORE_INDEX).sum())
        olp, a = info.meta.get(META_OLD_LOGPROBS), info.meta.get(META_ADVANTAGE)
        if olp is None or a is None:
            missing = [k for k, v in ((META_OLD_LOGPROBS, olp), (META_ADVANTAGE, a)) if v is None]
            raise GrpoInputError(
                f"segment {i} of the row has no {' / '.join(missing)} in its meta: build GRPO "
                "segments with grpo_segment"
            )
        if len(olp) != n:
            raise GrpoInputError(f"segment {i} of the row has {n} labelled tokens but {len(olp)} old log-probs")
        if n == 0:  # a fully masked completion: no token, no sequence (it would be 0/0 in the mean)
            continue
        old.extend(olp)
        adv.extend([float(a)] * n)
        inv.extend([1.0 / n] * n)
        seq.extend([n_seqs] * n)
        n_seqs += 1
    f32 = torch.float32
    return GrpoTokens(
        torch.tensor(old, dtype=f32),
        torch.tensor(adv, dtype=f32),
        torch.tensor(inv, dtype=f32),
        len(old),
        n_seqs,
        torch.tensor(seq, dtype=torch.int64),
    )


# ---- the loss ----------------------------------------------------------------------------------


def completion_logprobs(logits: torch.Tensor | RowHead, row: PackedRow, temperature: float = 1.0) -> torch.Tensor:
    """[n] fp32 log-probs of the row's labelled tokens, in row order, with grad. `logits` is [1, L, V]
    or [L, V], or a `RowHead` (logits made a chunk of labelled positions at a time, learner/core/head.py); the
    token at position p is predicted by the logits at p - 1 (a segment's first token is never labelled, so nothing
    is read across a segment boundary)."""
    logits = squeeze_row(logits, row.length)
    device = logits.hidden.device if isinstance(logits, RowHead) else logits.device
    labels = row.labels.reshape(-1).to(device)
    if row.ce_positions is not None:
        pos = row.ce_positions.to(device)
    else:  # a row built by hand
        pos = torch.nonzero(labels != IGNORE_INDEX).flatten()
    if pos.numel() == 0:
        return zero_of(logits).float().reshape(1)[:0]  # empty, but in the graph: backward still works
    # fused (temperature 1): liger-kernel's kernel, the log-prob being -CE of the token (learner/core/fused.py)
    return -token_ce(logits, pos - 1, labels[pos], temperature)


@dataclass
class GrpoOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


@dataclass
class GrpoSums:
    """Un-normalised sums of one or more rows: the loss sums with grad, the metric sums detached.
    `loss_token_sum` = sum of loss_t; `loss_seq_sum` = sum over sequences of their token mean."""

    loss_token_sum: torch.Tensor
    loss_seq_sum: torch.Tensor
    n_tokens: int
    n_seqs: int
    clipped: torch.Tensor
    ratio_sum: torch.Tensor
    kl_sum: torch.Tensor
    mismatch_kl_sum: torch.Tensor  # k3 of KL(behaviour || learner) per token, summed
    weight_sum: torch.Tensor  # the correction's importance weights w_t, summed (1 per token without one)
    corrected: torch.Tensor  # tokens whose weight the correction truncated or masked

    def __add__(self, other: GrpoSums) -> GrpoSums:
        return GrpoSums(
            self.loss_token_sum + other.loss_token_sum,
            self.loss_seq_sum + other.loss_seq_sum,
            self.n_tokens + other.n_tokens,
            self.n_seqs + other.n_seqs,
            self.clipped + other.clipped,
            self.ratio_sum + other.ratio_sum,
            self.kl_sum + other.kl_sum,
            self.mismatch_kl_sum + other.mismatch_kl_sum,
            self.weight_sum + other.weight_sum,
            self.corrected + other.corrected,
        )

    def finish(self, cfg: GrpoConfig, total_tokens: int | None = None, total_seqs: int | None = None) -> GrpoOutput:
        """The loss per `cfg.loss_norm` and token-mean metrics. With `total_tokens` / `total_seqs` (the
        counts of every row of the step, all ranks) one row's output is its share: summing the rows'
        losses and metrics gives what one pooled row would, while each row can be backwarded alone."""
        nt = max(self.n_tokens if total_tokens is None else total_tokens, 1)
        ns = max(self.n_seqs if total_seqs is None else total_seqs, 1)
        loss = self.loss_token_sum / nt if cfg.loss_norm == "token" else self.loss_seq_sum / ns
        metrics = {
            "clip_fraction": self.clipped / nt,
            "ratio_mean": self.ratio_sum / nt,
            "kl": self.kl_sum / nt,  # 0 when no reference log-probs were given
            "mismatch_kl": self.mismatch_kl_sum / nt,
            "is_weight_mean": self.weight_sum / nt,
            "corrected_fraction": self.corrected / nt,
            "completion_length": torch.tensor(self.n_tokens / ns),
            "tokens": torch.tensor(self.n_tokens),
            "sequences": torch.tensor(self.n_seqs),
        }
        return GrpoOutput(loss, metrics)


def grpo_sums(
    logprobs: torch.Tensor, tokens: GrpoTokens, cfg: GrpoConfig, ref_logprobs: torch.Tensor | None = None
) -> GrpoSums:
    """The per-token GRPO terms of one row (or any flat set of completion tokens), summed.

    `logprobs` [n] come from the policy being trained (with grad), `tokens` carries the sampling
    log-probs and advantages aligned with them, `ref_logprobs` [n] the reference policy's (no grad);
    it is required when `cfg.kl_coef > 0` and, when given with kl_coef 0, only reported."""
    n = tokens.n_tokens
    if logprobs.shape != (n,):
        raise GrpoInputError(f"{tuple(logprobs.shape)} log-probs for {n} completion tokens")
    if ref_logprobs is not None and ref_logprobs.shape != (n,):
        raise GrpoInputError(f"{tuple(ref_logprobs.shape)} reference log-probs for {n} completion tokens")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise GrpoInputError(f"kl_coef={cfg.kl_coef} needs the reference policy's log-probs (ref_logprobs)")
    logp = logprobs.float()
    dev = logp.device
    old, adv, inv = (t.to(dev, torch.float32) for t in (tokens.old_logprobs, tokens.advantages, tokens.inv_seq_len))
    # log(pi_learner / pi_behaviour) per token, no grad: the mismatch the metric reports and corrections weigh.
    log_rho = logp.detach() - old
    mismatch_kl_sum = (torch.exp(log_rho) - log_rho - 1.0).sum()
    if cfg.correction == "none":
        ratio = torch.exp(logp - old)  # against the behaviour policy: the clip is the only guard
        weight = torch.ones_like(logp)
        changed = torch.zeros_like(logp, dtype=torch.bool)
    else:
        ratio = torch.exp(logp - logp.detach())  # against the learner's own policy at the step's start: 1
        weight, changed = _correction_weights(log_rho, tokens, cfg)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.eps_high) * adv
    per_token = -weight * torch.minimum(unclipped, clipped)
    kl_sum = torch.zeros((), device=dev)
    if ref_logprobs is not None:
        d = ref_logprobs.to(dev, torch.float32).detach() - logp
        k3 = torch.exp(d) - d - 1.0
        kl_sum = k3.detach().sum()
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * k3
    # Clipped is active where min() took the clipped term: r > 1 + eps_high with A > 0, or
    # r < 1 - eps with A < 0; there the token gives no gradient (the trust region's job).
    active = (clipped < unclipped).detach()
    return GrpoSums(
        loss_token_sum=per_token.sum(),
        loss_seq_sum=(per_token * inv).sum(),
        n_tokens=n,
        n_seqs=tokens.n_seqs,
        clipped=active.float().sum(),
        ratio_sum=ratio.detach().sum(),
        kl_sum=kl_sum,
        mismatch_kl_sum=mismatch_kl_sum,
        weight_sum=weight.sum(),
        corrected=changed.float().sum(),
    )


def _correction_weights(
    log_rho: torch.Tensor, tokens: GrpoTokens, cfg: GrpoConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weight of every token under `cfg.correction` (module doc) and which tokens it truncated or
    masked. `log_rho` = learner minus behaviour log-probs, detached."""
    lo, hi = cfg.correction_bounds
    if cfg.correction == "tis":
        assert hi is not None, "tis has a high bound (CORRECTION_DEFAULTS)"
        rho = torch.exp(log_rho)
        return rho.clamp(max=hi), rho > hi
    if cfg.correction == "icepop":
        assert lo is not None and hi is not None, "icepop has both bounds (CORRECTION_DEFAULTS)"
        rho = torch.exp(log_rho)
        keep = (rho >= lo) & (rho <= hi)
        return torch.where(keep, rho, torch.zeros_like(rho)), ~keep
    if cfg.correction == "mis":
        if tokens.seq_index is None:
            raise GrpoInputError("correction mis needs each token's sequence (GrpoTokens.seq_index, from grpo_tokens)")
        idx = tokens.seq_index.to(log_rho.device)
        assert lo is not None and hi is not None, "mis has both bounds (CORRECTION_DEFAULTS)"
        # The answer's ratio is the product of its tokens' ratios: summed in log space (fp32 over a few thousand
        # tokens of |log rho| ~ 1e-2 is exact enough), exp'd once.
        seq_log = torch.zeros(tokens.n_seqs, device=log_rho.device, dtype=log_rho.dtype).index_add_(0, idx, log_rho)
        rho_seq = torch.exp(seq_log)
        keep = ((rho_seq >= lo) & (rho_seq <= hi))[idx]
        return torch.where(keep, rho_seq[idx], torch.zeros_like(log_rho)), ~keep
    raise GrpoInputError(f"unknown correction {cfg.correction!r}")


def grpo_row_sums(
    logits: torch.Tensor | RowHead,
    row: PackedRow,
    cfg: GrpoConfig,
    ref_logprobs: torch.Tensor | None = None,
    tokens: GrpoTokens | None = None,
) -> GrpoSums:
    """`grpo_sums` of a packed row from the policy's logits. Pass `tokens` (built from the CPU row)
    when the row is already on a device, to keep the host read of its labels out of the step."""
    toks = grpo_tokens(row) if tokens is None else tokens
    return grpo_sums(completion_logprobs(logits, row, cfg.temperature), toks, cfg, ref_logprobs)


def grpo_loss(
    logits: torch.Tensor | RowHead,
    row: PackedRow,
    cfg: GrpoConfig,
    ref_logprobs: torch.Tensor | None = None,
    tokens: GrpoTokens | None = None,
) -> GrpoOutput:
    """The GRPO loss of one packed row, normalised over the row alone."""
    return grpo_row_sums(logits, row, cfg, ref_logprobs, tokens).finish(cfg)
