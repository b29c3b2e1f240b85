"""The GRPO trainer (`spec.trainer: grpo`): the second algorithm on the same rollout pool.

One step, read top to bottom in `GrpoTrainer.run`:

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

Every step samples, so every step but the last is followed by a sync. Everything else is the training loop's
(`learner.train.loop`): the rollout source (server pool or in-process engine) and weight sync, ranks, the step
strategy (plain AdamW or ZeRO), checkpoints and resume, run.json, the reporter (TensorBoard, Prometheus),
held-out evaluation (a detection task) and the export.

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

import logging
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from learner.core.grpo import (
    GrpoTokens,
    completion_logprobs,
    group_advantages,
    grpo_row_sums,
    grpo_segment,
    grpo_tokens,
)
from learner.core.packing import PackedRow, Packer
from learner.data.episode import check_rollout_prompts, vision_safe_response
from learner.data.vision import patch_size, with_vision
from learner.rewards.interface import RewardConfigError, RewardInput
from learner.rewards.scoring import RewardScores, RewardSum, build_rewards, score_batch
from learner.rollouts.client import Rollout
from learner.rollouts.pool import ServersFile
from learner.tracking import metrics as m
from learner.train.config import grpo_setup, learning_rate
from learner.train.loop import TrainingLoop
from learner.train.results import GrpoStats, StepResult, Summary
from learner.train.rollout_matching import Trainer
from rmsft.jobspec import RolloutMatchingJob

__all__ = ["GrpoTrainer", "build_job_rewards", "trainer_class"]

log = logging.getLogger("rmsft.learner")

# Per-step sums of the device step (normalised by the step's totals, so rows and ranks add up).
_LOSS_METRICS = ("loss", "clip_fraction", "ratio_mean", "kl")


def trainer_class(job: RolloutMatchingJob) -> type[TrainingLoop]:
    """The learner `spec.trainer` asks for: `Trainer` (rollout-matching SFT) or `GrpoTrainer`."""
    return GrpoTrainer if job.spec.trainer == "grpo" else Trainer


def build_job_rewards(job: RolloutMatchingJob) -> RewardSum:
    """The weighted sum `spec.training.grpo.rewards` names, resolved now (built-in, entry point, import path);
    an error names the entry (`spec.training.grpo.rewards[i] (name): ...`)."""
    specs = [{"name": r.name, "weight": r.weight, "params": dict(r.params)} for r in job.spec.training.grpo.rewards]
    try:
        return build_rewards(specs)
    except RewardConfigError as exc:
        raise type(exc)(f"spec.training.grpo.{exc}") from exc


@dataclass
class _Groups:
    """This rank's share of a step's samples: whole groups, prompt by prompt, samples in order."""

    indices: list[int]  # record index of each completion (a prompt's index n times)
    rollouts: list[Rollout]  # this rank's completions
    responses: list[list[int]]  # the completion ids trained on (cut before a sampled image token)
    everything: list[Rollout]  # rank 0: the whole batch's completions; other ranks: their own


class GrpoTrainer(TrainingLoop):
    """The GRPO learner: the training loop (`TrainingLoop`) with GRPO steps; construction as there."""

    def __init__(self, job: RolloutMatchingJob, addresses: Sequence[str] | ServersFile, **kwargs) -> None:
        if job.spec.trainer != "grpo":
            raise ValueError(f"GrpoTrainer runs spec.trainer 'grpo' jobs, this one is {job.spec.trainer!r}")
        self.grpo = grpo_setup(job.spec.training)
        # Rewards are resolved before anything is paid for (a typo fails now, naming the entry).
        self.rewards = build_job_rewards(job)
        self._reward_pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            job.spec.training.grpo.reward_workers, thread_name_prefix="rmsft-reward")
        super().__init__(job, addresses, **kwargs)

    def _make_packer(self) -> Packer:
        return Packer(*self.grpo.packing)

    # -- one step -------------------------------------------------------------------------------
    def _train_step(self, t0: float) -> StepResult:
        batch = self.order.batch(self.state.step)
        groups = self._sample(batch)  # n completions per prompt, all from weight version state.version
        scores = self._score(groups)  # rewards of every completion, on the host
        advantages = group_advantages(scores.totals, self.grpo.n, scale=self.grpo.loss.scale_rewards)
        rows = self._pack(groups, advantages)  # one segment per completion -> packed rows (all of them)
        totals, n_rows, fill = self._update(rows)  # forward, loss, backward, optimizer
        return self._step_result(
            t0, rollouts=groups.everything, record_ids=[self.records[i].id for i in batch], loss=totals["loss"],
            parts={}, stats=None, rows=n_rows, fill=fill,
            local_record_ids=[self.records[i].id for i in groups.indices[:: self.grpo.n]],
            local_rows=len(rows), local_tokens=sum(r.length for r in rows), grpo=self._stats(groups, scores, totals),
        )

    def _samples_at(self, step: int) -> bool:  # noqa: ARG002 - every GRPO step samples from the latest weights
        return True

    # -- sample ---------------------------------------------------------------------------------
    def _sample(self, batch: tuple[int, ...]) -> _Groups:
        """Each rank gets the groups of its share of prompts (n per prompt; rank 0's pool samples the whole batch,
        or every rank's in-process engine its own share); every rank checks its completions: version, log-probs,
        and the prompt ids the engine rendered."""
        ranks, n = self.ranks, self.grpo.n
        self._step_prompts.clear()
        with self._phase("rollout"):
            # Sample k of prompt j is at j * n + k; each call is fenced to the version it was made with: the
            # learner's, or up to max_staleness behind it (generated ahead, overlap.py).
            outs, everything = self._rollouts_for(self.state.step, self.grpo.sampling, n=n)
        lo, hi = ranks.share(len(batch))
        indices = [i for i in batch[lo:hi] for _ in range(n)]
        with ranks.guard("checking the sampled completions"):
            if len(outs) != len(indices):
                raise RuntimeError(f"rank {ranks.rank} got {len(outs)} completion(s) for {hi - lo} prompt(s) x {n}")
            weights = self.state.weights  # this run's version: the number alone is not enough
            stale = [(o.request_id, str(o.weights), o.server) for o in outs if not self._within_window([o])]
            if stale:
                raise RuntimeError(f"{len(stale)} completion(s) not from the learner's weight version {weights} "
                                   f"(or max_staleness {self.cfg.rollout.max_staleness} behind it) "
                                   f"(request, version, server): {stale[:3]}")
            bad = [(o.request_id, o.sample_index, o.server) for o in outs
                   if o.logprobs is None or len(o.logprobs) != len(o.token_ids)]
            if bad:
                raise RuntimeError(f"{len(bad)} completion(s) came without one log-prob per token (request, sample, "
                                   f"server): {bad[:3]}; GRPO needs the servers' sampling log-probs")
            check_rollout_prompts([self.records[i] for i in indices], [self._prompt_ids(i) for i in indices], outs,
                                  self.policy.tokenizer)
            responses = [list(o.token_ids) for o in outs]
            if self.policy.is_vision_language:  # a sampled image/video token cannot be teacher-forced
                responses = [vision_safe_response(r, self.vision_token_ids) for r in responses]
        return _Groups(indices, list(outs), responses, everything if ranks.is_main else list(outs))

    def _e_step_samples(self, k: int) -> bool:  # noqa: ARG002 - every GRPO step samples (the recipe's channels are SFT's)
        return True

    # -- score ----------------------------------------------------------------------------------
    def _score(self, groups: _Groups) -> RewardScores:
        """Every completion's rewards, in order. Each is parsed with the run's output format first (a detection
        reward reads the objects; others ignore them). A failing reward names itself and the record."""
        tok, vl = self.policy.tokenizer, self.policy.is_vision_language
        with self._phase("reward"), self.ranks.guard("scoring the completions"):
            inputs = []
            for idx, out, resp in zip(groups.indices, groups.rollouts, groups.responses, strict=True):
                size = None
                if vl and self.core.fmt.needs_image_size:
                    size = self._vision_prompt(idx).image_size(patch_size(self.policy.processor))
                inputs.append(RewardInput.from_completion(
                    self.records[idx], tok.decode(resp, skip_special_tokens=True), resp,
                    vocab=self.policy.vocab, fmt=self.core.fmt, image_size=size,
                    finish_reason=out.finish_reason, sample_index=out.sample_index,
                ))
            return score_batch(self.rewards, inputs, executor=self._reward_pool)

    # -- pack -----------------------------------------------------------------------------------
    def _pack(self, groups: _Groups, advantages: torch.Tensor) -> list[PackedRow]:
        """One segment per completion (prompt unlabelled; its tokens labelled, with their sampling log-probs and
        the group advantage), every one of them packed into this step's rows."""
        with self._phase("pack"), self.ranks.guard("packing the completions"):
            segments = []
            for j, (idx, out, resp) in enumerate(zip(groups.indices, groups.rollouts, groups.responses, strict=True)):
                seg = grpo_segment(self._prompt_ids(idx), resp, out.logprobs[: len(resp)], float(advantages[j]),
                                   meta={"record_id": out.request_id, "sample_index": out.sample_index})
                if self.policy.is_vision_language:  # pixels and M-RoPE positions for the packed forward
                    seg = with_vision(self.model, seg, self._vision_prompt(idx))
                segments.append(seg)
            self.packer.add(segments)
            rows = []
            while (row := self.packer.next_row()) is not None:
                rows.append(row)
        m.BUFFER_SEGMENTS.set(self.packer.pending)
        return rows

    # -- update ---------------------------------------------------------------------------------
    def _update(self, rows: list[PackedRow]) -> tuple[dict[str, float], int, float]:
        """One optimizer step on every row of every rank; the loss is normalised by the step's totals over all
        ranks (completion tokens, or completions for loss_norm sequence). Returns the loss and the loss-side
        metrics summed over rows and ranks, the number of rows and their mean fill."""
        tokens = [grpo_tokens(r) for r in rows]  # host reads of the labels, before the rows move
        n_tokens, n_seqs, n_rows, fill_sum = self.ranks.sum([
            sum(t.n_tokens for t in tokens), sum(t.n_seqs for t in tokens), len(rows), sum(r.fill for r in rows),
        ])
        if not n_rows:
            raise RuntimeError("the step's completions packed into no row")
        lr = learning_rate(self.cfg, self.state.step)
        with self.ranks.guard("forward/backward"):
            sums = self.grpo_device_step(rows, tokens, int(n_tokens), int(n_seqs), lr)
        # The only host reads of the step: after it, once.
        total = self.ranks.sum([float(sums[k]) for k in _LOSS_METRICS])
        return dict(zip(_LOSS_METRICS, total, strict=True)), int(n_rows), fill_sum / n_rows

    def grpo_device_step(self, rows: list[PackedRow], tokens: list[GrpoTokens], total_tokens: int, total_seqs: int,
                         lr: float) -> dict[str, torch.Tensor]:
        """Forward/backward of every row on the training device, then the optimizer step. Each row's loss is its
        share of the step's (normalised by the global totals), so the rows' gradients add up to the pooled
        loss's. Returns the loss and metrics summed over the rows, as device tensors (no host reads)."""
        cfg, device = self.grpo.loss, self.train_step.device
        if len(rows) != len(tokens):
            raise ValueError(f"{len(rows)} row(s) but {len(tokens)} token count(s)")

        def prepare(i: int, row: PackedRow) -> tuple[GrpoTokens, torch.Tensor | None]:
            ref = self._reference_logprobs(row) if cfg.kl_coef > 0 else None
            return tokens[i].to(device), ref

        def row_loss(row: PackedRow, logits: torch.Tensor, before: tuple[GrpoTokens, torch.Tensor | None]
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            row_tokens, ref = before
            out = grpo_row_sums(logits, row, cfg, ref, row_tokens).finish(cfg, total_tokens, total_seqs)
            return out.loss, {k: out.metrics[k] for k in _LOSS_METRICS[1:]}

        return self._optimize(rows, lr, row_loss, prepare)

    def _reference_logprobs(self, row: PackedRow) -> torch.Tensor:
        """The reference policy's log-probs of the row's completion tokens: the base weights (LoRA/DoRA adapters
        disabled; the job spec refuses kl_coef > 0 without LoRA), at the sampling temperature, without grad."""
        with self._phase("reference"), torch.no_grad(), self.model.disable_adapter(), self.train_step.autocast():
            logits = self.model(**row.model_inputs()).logits
            return completion_logprobs(logits, row, self.grpo.loss.temperature)

    # -- reporting ------------------------------------------------------------------------------
    def _stats(self, groups: _Groups, scores: RewardScores, totals: dict[str, float]) -> GrpoStats:
        """The step's reward and completion figures over every rank (sums exchanged once)."""
        n = self.grpo.n
        r = torch.tensor(scores.totals, dtype=torch.float64).reshape(-1, n)
        labels = list(scores.per_reward)
        local = [
            float(r.sum()), float((r * r).sum()), float(r.numel()), float(r.std(dim=1).sum()), float(r.shape[0]),
            float((r.amax(dim=1) == r.amin(dim=1)).sum()),
            float(sum(len(x) for x in groups.responses)),
            float(sum(o.finish_reason == "length" for o in groups.rollouts)),
            *(math.fsum(scores.per_reward[k]) for k in labels),
        ]
        s = self.ranks.sum(local)
        count, n_groups = max(s[2], 1.0), max(s[4], 1.0)
        mean = s[0] / count
        return GrpoStats(
            reward_mean=mean, reward_std=math.sqrt(max(s[1] / count - mean * mean, 0.0)),
            group_reward_std=s[3] / n_groups, zero_std_groups=s[5] / n_groups,
            rewards={k: v / count for k, v in zip(labels, s[8:], strict=True)},
            clip_fraction=totals["clip_fraction"], ratio_mean=totals["ratio_mean"], kl=totals["kl"],
            completion_length=s[6] / count, truncated=s[7] / count, completions=int(s[2]), groups=int(s[4]),
        )

    def _step_metrics(self, r: StepResult) -> None:
        g = r.grpo
        m.REWARD.labels("mean").set(g.reward_mean)
        m.REWARD.labels("std").set(g.reward_std)
        m.REWARD.labels("group_std").set(g.group_reward_std)
        for label, v in g.rewards.items():
            m.REWARD_PART.labels(label).set(v)
        m.ZERO_STD_GROUPS.set(g.zero_std_groups)
        m.CLIP_FRACTION.set(g.clip_fraction)
        m.GRPO_KL.set(g.kl)
        m.COMPLETION_LENGTH.set(g.completion_length)

    def _step_line(self, r: StepResult) -> str:
        g = r.grpo
        return (f"step {r.step} v{r.weight_version} loss {r.loss:.4f} reward {g.reward_mean:.3f} (std "
                f"{g.reward_std:.3f}, flat groups {g.zero_std_groups:.2f}) clip {g.clip_fraction:.3f} ratio "
                f"{g.ratio_mean:.4f} kl {g.kl:.4f} len {g.completion_length:.1f} rows {r.rows} fill {r.fill:.3f} "
                f"{r.seconds:.2f}s")

    def summary(self, wall: float) -> Summary:
        out = super().summary(wall)
        out.rewards = [h.grpo.reward_mean for h in self.history if h.grpo is not None]
        return out

    def close(self) -> None:
        pool, self._reward_pool = getattr(self, "_reward_pool", None), None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        super().close()
