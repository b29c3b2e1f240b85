"""The GRPO objective (`spec.trainer: grpo`): the second algorithm on the same rollout pool.

One step (`build`, then the loop's update with `row_loss`):

    sample   n completions per prompt with their log-probs, from the pool, fenced (every completion carries the
             learner's weight version; a retry on another server reuses the same per-sample seeds)
    score    every completion by the job's rewards (`learner.rewards.scoring.score_batch` on a thread pool, on the host,
             before the device step)
    advantage  group-normalised per prompt (`learner.core.grpo.group_advantages`; an all-equal group gets 0)
    pack     one segment per completion (`grpo_segment`: its sampling log-probs and advantage ride along), every
             segment of the step packed into rows (the packer is drained: nothing is carried to a later version)
    update   forward, GRPO loss (clipped ratio against the sampling log-probs; the reference policy's log-probs,
             the adapters disabled, when kl_coef > 0), backward, optimizer
    sync     the new weights to every server (spec.sync.mode, FULL by default) before the next step samples.

Sampling rules (spec.training.grpo; both off by default, which leaves a step as above):
    dynamic_sampling  a group whose rewards are all equal has zero advantage: no signal, but with loss_norm token
             its tokens still count in the normaliser and dilute the others. `drop` leaves such groups out of the
             loss and the normaliser (DAPO's dynamic sampling without the refill); `resample` first samples those
             prompts again, from the current weights with new seeds (RESAMPLE_SEED_OFFSET per round), keeping a
             group that came back with signal, up to dynamic_sampling_rounds rounds, then drops what is still flat.
             DAPO refills the batch with new prompts; rmsft keeps the data order's prompts (a step's batch is a
             pure function of its index), so it resamples the same ones: a prompt too hard for 8 samples gets 16.
             A rank whose every group is flat keeps one, fully masked, so it still has a row to step on.
    overlong  answers cut at max_tokens (finish reason length). `mask`: their tokens leave the loss (DAPO's overlong
             filtering; they still count in their group's advantage); `penalty`: DAPO's soft overlong punishment,
             added to the reward before the advantages, for an answer of L tokens, budget L_max = max_tokens and
             buffer B = overlong_buffer (max_tokens // 4 unset): 0 for L <= L_max - B, else
             -overlong_penalty * (L - (L_max - B)) / B (so -overlong_penalty at L_max). rmsft's servers stop at
             L_max, so the penalty ramps over the last B tokens of the budget.

Every step samples, so every step but the last is followed by a sync. Everything else is the training loop's
(`learner.train.loop`) and the rollout feed's (`learner.train.feed`): the rollout source (server pool or in-process
engine) and weight sync, ranks, the step strategy (plain AdamW or ZeRO), checkpoints and resume, run.json, the
reporter (TensorBoard, Prometheus), held-out evaluation (a detection task) and the export.

Temperature: the servers of a GRPO job report log-probs of the distribution they sampled from (vLLM's
`logprobs_mode="processed_logprobs"`: after temperature; `rmsft.serve_options` asks for it) and the learner
divides its logits by the same `training.grpo.temperature` (`GrpoConfig.temperature`), so the importance ratio
compares one distribution. Top-p, top-k and penalties are refused by the job spec: the learner could not
reproduce them. With one optimizer step per batch the ratio departs from 1 only by what the engine and the
learner compute differently (`grpo/ratio_mean` shows it); the clip bounds that gap.

Several ranks: rank 0 samples the whole batch and hands each rank the groups of its contiguous share of prompts
(whole groups, so advantages need no exchange); each rank scores its own groups; the loss is normalised by
totals over all ranks (tokens or sequences, counted before the forward), so the step is one process training on
every completion.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from learner.core.format_watch import FormatWatch
from learner.core.grpo import (
    GrpoTokens,
    completion_logprobs,
    group_advantages,
    grpo_row_sums,
    grpo_segment,
    grpo_tokens,
)
from learner.core.head import RowHead, row_outputs
from learner.core.packing import PackedRow, Packer
from learner.data.episode import check_rollout_prompts
from learner.data.vision import patch_size, with_vision
from learner.rewards.interface import RewardConfigError, RewardInput
from learner.rewards.scoring import RewardScores, RewardSum, build_rewards, score_batch
from learner.rollouts.client import Rollout
from learner.tracking import metrics as m
from learner.train.config import grpo_setup
from learner.train.feed import RESAMPLE_SEED_OFFSET
from learner.train.objectives.base import Built, Objective, Prepare, RowLoss, StepOutcome, StepPlan
from learner.train.results import GrpoStats, StepResult
from rmsft.jobspec import RolloutMatchingJob

__all__ = ["Grpo", "build_job_rewards"]

# Per-step sums of the device step (normalised by the step's totals, so rows and ranks add up).
_LOSS_METRICS = ("loss", "clip_fraction", "ratio_mean", "kl", "mismatch_kl", "is_weight_mean", "corrected_fraction")


class _PeftModel(Protocol):
    """What the reference forward needs of a PEFT model: its base weights, adapters off, for a block."""

    def disable_adapter(self) -> AbstractContextManager[Any]: ...


def build_job_rewards(job: RolloutMatchingJob) -> RewardSum:
    """The weighted sum `spec.training.grpo.rewards` names, resolved now (built-in, entry point, import path);
    an error names the entry (`spec.training.grpo.rewards[i] (name): ...`)."""
    specs = [{"name": r.name, "weight": r.weight, "params": dict(r.params)} for r in job.spec.training.grpo.rewards]
    try:
        return build_rewards(specs)
    except RewardConfigError as exc:
        raise type(exc)(f"spec.training.grpo.{exc}") from exc


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment of an answer of `length` tokens (module doc): 0 up to max_tokens - buffer,
    then linear down to -penalty at max_tokens (and beyond)."""
    if buffer < 1 or buffer >= max_tokens:
        raise ValueError(f"overlong buffer must be in [1, max_tokens), got {buffer} for max_tokens {max_tokens}")
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min(length - start, buffer) / buffer


def flat_groups(rewards: Sequence[float], n: int) -> list[bool]:
    """Per group of `n` consecutive rewards: True when they are all equal (zero advantage, no signal)."""
    if len(rewards) % n:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {n}")
    return [max(rewards[j : j + n]) == min(rewards[j : j + n]) for j in range(0, len(rewards), n)]


@dataclass
class _Rules:
    """What the sampling rules did to a step (module doc), this rank's counts."""

    dropped: int = 0  # groups left out of the loss as flat
    resampled: int = 0  # groups sampled again (each round counts)
    masked: int = 0  # answers cut at the budget whose tokens left the loss
    penalised: int = 0  # answers whose reward the overlong penalty lowered


@dataclass
class _Groups:
    """This rank's share of a step's samples: whole groups, prompt by prompt, samples in order."""

    indices: list[int]  # record index of each completion (a prompt's index n times)
    rollouts: list[Rollout]  # this rank's completions
    responses: list[list[int]]  # the completion ids trained on (cut before a sampled image token)
    everything: list[Rollout]  # rank 0: the whole batch's completions; other ranks: their own


class Grpo(Objective):
    """GRPO (module doc). The rewards are resolved at construction: a typo fails before anything is paid for,
    naming the entry."""

    name = "grpo"
    loss_keys = _LOSS_METRICS
    chunked_logits = True  # grpo_row_sums takes a RowHead

    def __init__(self, job: RolloutMatchingJob) -> None:
        if job.spec.trainer != "grpo":
            raise ValueError(f"the GRPO objective runs spec.trainer 'grpo' jobs, this one is {job.spec.trainer!r}")
        super().__init__(job)
        self.grpo = grpo_setup(self.cfg)
        self.rewards = build_job_rewards(job)
        self._format_watch: FormatWatch | None = None  # rank 0: completions that parse to nothing
        self._reward_pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            self.cfg.grpo.reward_workers, thread_name_prefix="rmsft-reward"
        )

    def make_packer(self) -> Packer:
        return Packer(*self.grpo.packing)

    def plan(self, step: int) -> StepPlan:
        """Every step samples its own batch from the newest weights."""
        return StepPlan(step=step, e_step=step, batch=self.inputs.order.batch(step), builds=True, samples=True)

    # -- sample, score, pack ------------------------------------------------------------------------------
    def build(self, plan: StepPlan) -> Built:
        g, n, rules = self.cfg.grpo, self.grpo.n, _Rules()
        groups = self._sample(plan)  # n completions per prompt, all from weight version state.version
        scores = self._score(groups)  # rewards of every completion, on the host
        if g.dynamic_sampling == "resample":
            groups, scores = self._resample(plan, groups, scores, rules)
        rewards = self._shaped_rewards(groups, scores, rules)
        advantages = group_advantages(rewards, n, scale=self.grpo.loss.scale_rewards)
        keep = [True] * (len(rewards) // n)
        if g.dynamic_sampling != "off":
            keep = [not f for f in flat_groups(rewards, n)]
            rules.dropped = keep.count(False)
        rows = self._pack(groups, advantages, keep, rules)  # one segment per completion -> packed rows
        records = self.inputs.records
        return Built(
            rows,
            [records[i].id for i in groups.indices[::n]],
            {
                "groups": groups,
                "scores": scores,
                "rewards": rewards,
                "rules": rules,
                "tokens": [grpo_tokens(r) for r in rows],  # host reads of the labels, before the rows move
            },
        )

    def _shaped_rewards(self, groups: _Groups, scores: RewardScores, rules: _Rules) -> list[float]:
        """The rewards the advantages are computed from: the job's, plus the overlong penalty when it is on."""
        g = self.cfg.grpo
        rewards = list(scores.totals)
        if g.overlong != "penalty":
            return rewards
        buffer = g.overlong_buffer if g.overlong_buffer is not None else max(1, g.max_tokens // 4)
        for j, out in enumerate(groups.rollouts):
            p = overlong_penalty(len(out.token_ids), g.max_tokens, buffer, g.overlong_penalty)
            if p:
                rewards[j] += p
                rules.penalised += 1
        return rewards

    def _resample(
        self, plan: StepPlan, groups: _Groups, scores: RewardScores, rules: _Rules
    ) -> tuple[_Groups, RewardScores]:
        """dynamic_sampling resample: each flat group's prompt sampled again (collective: every rank takes part in
        every round any rank needs), a group that comes back with signal replacing it; at most
        dynamic_sampling_rounds rounds."""
        inp, n, g = self.inputs, self.grpo.n, self.cfg.grpo
        lo, _ = inp.ranks.share(len(plan.batch))
        rollouts, responses = list(groups.rollouts), list(groups.responses)
        totals = list(scores.totals)
        parts = {k: list(v) for k, v in scores.per_reward.items()}
        for r in range(1, g.dynamic_sampling_rounds + 1):
            now = RewardScores(tuple(totals), {k: tuple(v) for k, v in parts.items()})
            flat = [
                j
                for j, f in enumerate(
                    flat_groups(
                        self._shaped_rewards(_Groups(groups.indices, rollouts, responses, []), now, _Rules()), n
                    )
                )
                if f
            ]
            if not int(inp.ranks.sum([float(len(flat))])[0]):
                break
            with inp.phases.time("rollout"):
                outs = inp.feed.resample(
                    plan.step, [lo + j for j in flat], self.grpo.sampling, seed_offset=r * RESAMPLE_SEED_OFFSET
                )
            indices = [groups.indices[j * n] for j in flat for _ in range(n)]
            fresh = _Groups(indices, list(outs), self._check(outs, indices), [])
            new_scores = self._score(fresh)
            rules.resampled += len(flat)
            fresh_flat = flat_groups(self._shaped_rewards(fresh, new_scores, _Rules()), n) if flat else []
            for a, (j, still_flat) in enumerate(zip(flat, fresh_flat, strict=True)):
                if still_flat:
                    continue
                src, dst = slice(a * n, (a + 1) * n), slice(j * n, (j + 1) * n)
                rollouts[dst], responses[dst] = fresh.rollouts[src], fresh.responses[src]
                totals[dst] = new_scores.totals[src]
                for k in parts:
                    parts[k][dst] = new_scores.per_reward[k][src]
        # One process: the batch reported is the one trained on. Several ranks: rank 0 reports the batch as first
        # sampled (gathering the replacements would cost an exchange for the run record alone).
        everything = rollouts if not inp.ranks.enabled else groups.everything
        return (
            _Groups(groups.indices, rollouts, responses, everything),
            RewardScores(tuple(totals), {k: tuple(v) for k, v in parts.items()}),
        )

    def _sample(self, plan: StepPlan) -> _Groups:
        """Each rank gets the groups of its share of prompts (n per prompt; rank 0's pool samples the whole batch,
        or every rank's in-process engine its own share); every rank checks its completions: version, log-probs,
        and the prompt ids the engine rendered."""
        inp, feed, ranks, n = self.inputs, self.inputs.feed, self.inputs.ranks, self.grpo.n
        feed.new_e_step()
        with inp.phases.time("rollout"):
            # Sample k of prompt j is at j * n + k; each call is fenced to the version it was made with: the
            # learner's, or up to max_staleness behind it (generated ahead, overlap.py).
            outs, everything = feed.rollouts(
                plan.step, self.grpo.sampling, n=n, upcoming=range(plan.step + 1, self.cfg.steps)
            )
        lo, hi = ranks.share(len(plan.batch))
        indices = [i for i in plan.batch[lo:hi] for _ in range(n)]
        responses = self._check(outs, indices)
        if not ranks.is_main:
            return _Groups(indices, list(outs), responses, list(outs))
        assert everything is not None, "rank 0 gets the whole batch (feed.rollouts)"
        return _Groups(indices, list(outs), responses, everything)

    def _check(self, outs: Sequence[Rollout], indices: Sequence[int]) -> list[list[int]]:
        """Every rank checks its completions (one per entry of `indices`, the record of each): version, log-probs,
        and the prompt ids the engine rendered; returns their trainable responses."""
        inp, feed, ranks, n = self.inputs, self.inputs.feed, self.inputs.ranks, self.grpo.n
        with ranks.guard("checking the sampled completions"):
            if len(outs) != len(indices):
                raise RuntimeError(
                    f"rank {ranks.rank} got {len(outs)} completion(s) for {len(indices) // n} prompt(s) x {n}"
                )
            weights = inp.state.weights  # this run's version: the number alone is not enough
            stale = [(o.request_id, str(o.weights), o.server) for o in outs if not feed.within_window([o])]
            if stale:
                raise RuntimeError(
                    f"{len(stale)} completion(s) not from the learner's weight version {weights} "
                    f"(or max_staleness {self.cfg.rollout.max_staleness} behind it) "
                    f"(request, version, server): {stale[:3]}"
                )
            bad = [
                (o.request_id, o.sample_index, o.server)
                for o in outs
                if o.logprobs is None or len(o.logprobs) != len(o.token_ids)
            ]
            if bad:
                raise RuntimeError(
                    f"{len(bad)} completion(s) came without one log-prob per token (request, sample, "
                    f"server): {bad[:3]}; GRPO needs the servers' sampling log-probs"
                )
            check_rollout_prompts(
                [inp.records[i] for i in indices], [feed.prompt_ids(i) for i in indices], outs, inp.policy.tokenizer
            )
            responses = feed.trainable_responses(outs)
        return responses

    def _score(self, groups: _Groups) -> RewardScores:
        """Every completion's rewards, in order. Each is parsed with the run's output format first (a detection
        reward reads the objects; others ignore them). A failing reward names itself and the record."""
        inp = self.inputs
        tok, vl, fmt = inp.policy.tokenizer, inp.policy.is_vision_language, inp.core.fmt
        with inp.phases.time("reward"), inp.ranks.guard("scoring the completions"):
            inputs = []
            for idx, out, resp in zip(groups.indices, groups.rollouts, groups.responses, strict=True):
                size = None
                if vl and fmt.needs_image_size:
                    size = inp.feed.vision_prompt(idx).image_size(patch_size(inp.policy.processor))
                inputs.append(
                    RewardInput.from_completion(
                        inp.records[idx],
                        tok.decode(resp, skip_special_tokens=True),
                        resp,
                        vocab=inp.policy.vocab,
                        fmt=fmt,
                        image_size=size,
                        finish_reason=out.finish_reason,
                        sample_index=out.sample_index,
                    )
                )
            self._watch_format(inputs, groups.responses)
            return score_batch(self.rewards, inputs, executor=self._reward_pool)

    def _watch_format(self, inputs: Sequence[RewardInput], responses: Sequence[Sequence[int]]) -> None:
        """Detection completions in another format than training.format parse to nothing: say so, once
        (learner/core/format_watch.py); text tasks (no ground-truth objects) never trigger it."""
        if not self.inputs.ranks.is_main or not any(i.parsed is not None for i in inputs):
            return
        if self._format_watch is None:
            self._format_watch = FormatWatch(self.inputs.core.fmt, self.inputs.policy.vocab)
        predicted = sum(len(i.objects or ()) for i in inputs)
        self._format_watch.observe(responses, predicted, sum(len(i.record.objects) for i in inputs))

    def _pack(self, groups: _Groups, advantages: torch.Tensor, keep: Sequence[bool], rules: _Rules) -> list[PackedRow]:
        """One segment per completion of a kept group (prompt unlabelled; its tokens labelled, with their sampling
        log-probs and the group advantage; an answer cut at the budget unlabelled under overlong mask), every one of
        them packed into this step's rows. A rank that keeps no group packs its first completion fully masked."""
        inp, n = self.inputs, self.grpo.n
        mask_overlong = self.cfg.grpo.overlong == "mask"
        with inp.phases.time("pack"), inp.ranks.guard("packing the completions"):
            segments = []
            for j, (idx, out, resp) in enumerate(zip(groups.indices, groups.rollouts, groups.responses, strict=True)):
                assert out.logprobs is not None, "_check refuses completions without log-probs"
                masked = not keep[j // n]
                if masked and (any(keep) or j > 0):
                    continue  # a flat group left out (dynamic_sampling)
                cut = mask_overlong and out.finish_reason == "length"
                rules.masked += int(cut and not masked)
                seg = grpo_segment(
                    inp.feed.prompt_ids(idx),
                    resp,
                    out.logprobs[: len(resp)],
                    float(advantages[j]),
                    completion_mask=[False] * len(resp) if (cut or masked) else None,
                    meta={"record_id": out.request_id, "sample_index": out.sample_index},
                )
                if inp.policy.is_vision_language:  # pixels and M-RoPE positions for the packed forward
                    seg = with_vision(inp.model, seg, inp.feed.vision_prompt(idx))
                segments.append(seg)
            inp.packer.add(segments)
            rows = []
            while (row := inp.packer.next_row()) is not None:
                rows.append(row)
        m.PACKER_PENDING.set(inp.packer.pending)
        return rows

    # -- update -------------------------------------------------------------------------------------------
    def denominators(self, built: Built) -> list[float]:
        """Completion tokens and completions on this rank (loss_norm token or sequence)."""
        tokens = built.extra["tokens"]
        return [sum(t.n_tokens for t in tokens), sum(t.n_seqs for t in tokens)]

    def row_loss(self, built: Built, totals: Sequence[float]) -> tuple[RowLoss, Prepare | None]:
        """Each row's GRPO loss normalised by the step's totals over every rank (so the rows' gradients add up to
        the pooled loss's); before a row's forward, its token counts on the device and, with kl_coef > 0, the
        reference policy's log-probs."""
        cfg, tokens = self.grpo.loss, built.extra["tokens"]
        total_tokens, total_seqs = (int(t) for t in totals)
        if len(built.rows) != len(tokens):
            raise ValueError(f"{len(built.rows)} row(s) but {len(tokens)} token count(s)")

        def prepare(i: int, row: PackedRow) -> tuple[GrpoTokens, torch.Tensor | None]:
            ref = self._reference_logprobs(row) if cfg.kl_coef > 0 else None
            return tokens[i].to(row.input_ids.device), ref

        def row_loss(
            row: PackedRow, logits: torch.Tensor | RowHead, before: tuple[GrpoTokens, torch.Tensor | None]
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            row_tokens, ref = before
            out = grpo_row_sums(logits, row, cfg, ref, row_tokens).finish(cfg, total_tokens, total_seqs)
            return out.loss, {k: out.metrics[k] for k in _LOSS_METRICS[1:]}

        return row_loss, prepare

    def _reference_logprobs(self, row: PackedRow) -> torch.Tensor:
        """The reference policy's log-probs of the row's completion tokens: the base weights (LoRA/DoRA adapters
        disabled; the job spec refuses kl_coef > 0 without LoRA), at the sampling temperature, without grad."""
        inp = self.inputs
        # A PEFT model (the job spec refuses kl_coef > 0 without LoRA), typed only as a torch Module in the loop.
        adapted = cast(_PeftModel, inp.model)
        with inp.phases.time("reference"), torch.no_grad(), adapted.disable_adapter(), inp.updater.autocast():
            logits = row_outputs(
                inp.model, inp.model, row.model_inputs(), self.cfg.loss.logits, self.cfg.loss.logits_chunk
            )
            return completion_logprobs(logits, row, self.grpo.loss.temperature)

    # -- reporting ------------------------------------------------------------------------------------------
    def outcome(self, built: Built, sums: Mapping[str, float]) -> StepOutcome:
        groups = built.extra["groups"]
        return StepOutcome(
            rollouts=groups.everything,
            figures=self._stats(groups, built.extra["scores"], sums, built.extra["rewards"], built.extra["rules"]),
        )

    def _stats(
        self, groups: _Groups, scores: RewardScores, totals: Mapping[str, float], shaped: Sequence[float], rules: _Rules
    ) -> GrpoStats:
        """The step's reward and completion figures over every rank (sums exchanged once). The reward figures are
        the job's rewards; the flat groups those of the rewards the advantages came from (with any overlong
        penalty)."""
        n = self.grpo.n
        r = torch.tensor(scores.totals, dtype=torch.float64).reshape(-1, n)
        flat = sum(flat_groups(list(shaped), n))
        labels = list(scores.per_reward)
        local = [
            float(r.sum()),
            float((r * r).sum()),
            float(r.numel()),
            float(r.std(dim=1).sum()),
            float(r.shape[0]),
            float(flat),
            float(sum(len(x) for x in groups.responses)),
            float(sum(o.finish_reason == "length" for o in groups.rollouts)),
            float(rules.dropped),
            float(rules.resampled),
            float(rules.masked),
            float(rules.penalised),
            *(math.fsum(scores.per_reward[k]) for k in labels),
        ]
        s = self.inputs.ranks.sum(local)
        count, n_groups = max(s[2], 1.0), max(s[4], 1.0)
        mean = s[0] / count
        return GrpoStats(
            reward_mean=mean,
            reward_std=math.sqrt(max(s[1] / count - mean * mean, 0.0)),
            group_reward_std=s[3] / n_groups,
            zero_std_groups=s[5] / n_groups,
            rewards={k: v / count for k, v in zip(labels, s[12:], strict=True)},
            clip_fraction=totals["clip_fraction"],
            ratio_mean=totals["ratio_mean"],
            kl=totals["kl"],
            completion_length=s[6] / count,
            truncated=s[7] / count,
            completions=int(s[2]),
            groups=int(s[4]),
            mismatch_kl=totals["mismatch_kl"],
            is_weight_mean=totals["is_weight_mean"],
            corrected_fraction=totals["corrected_fraction"],
            dropped_groups=int(s[8]),
            resampled_groups=int(s[9]),
            overlong_masked=int(s[10]),
            overlong_penalised=int(s[11]),
        )

    def line(self, r: StepResult) -> str:
        g = r.figures
        assert isinstance(g, GrpoStats), "a GRPO step's figures (outcome())"
        return (
            f"step {r.step} v{r.weight_version} loss {r.loss:.4f} reward {g.reward_mean:.3f} (std "
            f"{g.reward_std:.3f}, flat groups {g.zero_std_groups:.2f}) clip {g.clip_fraction:.3f} ratio "
            f"{g.ratio_mean:.4f} kl {g.kl:.4f} mismatch kl {g.mismatch_kl:.2e} len {g.completion_length:.1f} "
            f"rows {r.rows} fill {r.fill:.3f} {r.seconds:.2f}s"
            + (
                f" dropped {g.dropped_groups} resampled {g.resampled_groups}"
                if g.dropped_groups or g.resampled_groups
                else ""
            )
            + (
                f" overlong masked {g.overlong_masked} penalised {g.overlong_penalised}"
                if g.overlong_masked or g.overlong_penalised
                else ""
            )
        )

    def close(self) -> None:
        pool, self._reward_pool = self._reward_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
