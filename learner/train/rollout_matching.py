"""Rollout-matching SFT, the objective of `spec.trainer: rollout_matching`: what one optimizer step of the training
loop (`learner.train.loop`) is.

One step, read top to bottom in `Trainer._train_step`:

    E-step   this step's rollouts, by the recipe's channel (`_e_step`):
               channel A  no generation: an empty answer makes the targets the whole ground truth (the warm start's
                          steps are channel A too)
               channel B  the model's own answers (the anchor, plus explorers with recipe generation 2), from the
                          rollout source within the staleness window (`learner.train.handout`)
             then parse -> match -> targets -> segments (`learner.data.episode.build_segments`) -> packed rows.
             With the rollout buffer on, one E-step feeds `m_steps` optimizer steps.
    M-step   forward, loss, backward, optimizer on the packed rows (`_m_step`): the token-level mean over every
             row of every rank, same as one big packed row.

Weights are synced only before an E-step that samples (and once before the first), never per micro-step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from learner.core.losses import loss_sums, row_totals
from learner.core.packing import PackedRow, Packer
from learner.core.rollout_buffer import RolloutBuffer
from learner.data.episode import EpisodeStats, build_segments, check_rollout_prompts, vision_safe_response
from learner.data.vision import patch_size, with_vision
from learner.rollouts.client import Rollout
from learner.tracking import metrics as m
from learner.train.config import learning_rate
from learner.train.loop import TrainingLoop
from learner.train.results import StepResult

__all__ = ["Trainer"]

log = logging.getLogger("rmsft.learner")


@dataclass
class _Built:
    rows: list[PackedRow]
    stats: EpisodeStats  # counts summed over ranks, timings of this rank
    rollouts: list[Rollout]  # rank 0: the whole batch; other ranks: their share
    local_ids: list[str]
    channel: str = "B"  # "B": rollout matching on fresh rollouts; "A": the ground truth (warm start too)


_PARTS = ("ce", "soft_ce", "w1", "gate", "coord", "geo", "ul")
_COUNTS = ("rollouts", "matched", "false_positives", "false_negatives", "dropped", "truncated", "response_tokens",
           "predicted", "gt_objects", "duplicates", "dead", "recovered", "fallback")


class Trainer(TrainingLoop):
    """The rollout-matching learner: the training loop (`TrainingLoop`) with channel A/B E-steps and the
    rollout-matching loss. Construction as `TrainingLoop`; `Path` arguments as there."""

    def _make_packer(self) -> Packer:
        return Packer(*self.core.packing)

    def _setup_objective(self) -> None:
        self.buffer = RolloutBuffer(self.core.m_steps)  # one E-step feeds m_steps optimizer steps

    # -- one step -------------------------------------------------------------------------------
    def _train_step(self, t0: float) -> StepResult:
        st = self.state
        batch = self.order.batch(st.step // self.core.m_steps)
        fresh = self.buffer.uses_left == 0
        built: _Built = self.buffer.get(batch, self._e_step)  # rollouts -> targets -> pack
        loss, parts, n_rows, fill = self._m_step(built.rows)  # forward/backward/optimizer
        return self._step_result(
            t0, rollouts=built.rollouts if fresh else [], record_ids=[self.records[i].id for i in batch], loss=loss,
            parts=parts, channel=built.channel, stats=built.stats if fresh else None, rows=n_rows, fill=fill,
            local_record_ids=list(built.local_ids), local_rows=len(built.rows),
            local_tokens=sum(r.length for r in built.rows),
        )

    def _samples_at(self, step: int) -> bool:
        """Step `step` starts a new E-step (the buffer is used up) and that E-step is channel B."""
        return self.buffer.uses_left == 0 and self._e_step_samples(step // self.core.m_steps)

    # -- E-step ---------------------------------------------------------------------------------
    def _e_step(self, batch: tuple[int, ...]) -> _Built:
        """The E-step of `batch`: this rank's share of its rollouts (by the step's channel), built into segments
        and packed into this step's rows."""
        ranks = self.ranks
        self._step_prompts.clear()
        k = self.state.step // self.core.m_steps
        channel_b = self._e_step_samples(k)
        with self._phase("rollout"):
            outs, everything, explorers = self._channel_b_rollouts(k) if channel_b else self._channel_a_rollouts(batch)
        lo, hi = ranks.share(len(batch))
        mine = batch[lo:hi]
        with ranks.guard("building training segments"):
            if len(outs) != len(mine) or not self._within_window(outs):
                raise RuntimeError(f"rank {ranks.rank} got {len(outs)} rollout(s) for {len(mine)} prompt(s) "
                                   f"or a weight version outside {self.state.weights} minus max_staleness "
                                   f"{self.cfg.rollout.max_staleness}")
            recs = [self.records[i] for i in mine]
            vl = self.policy.is_vision_language
            vision = [self._vision_prompt(i) for i in mine] if vl else []
            mine_ids = [v.input_ids for v in vision] if vl else [self._prompt(i) for i in mine]
            check_rollout_prompts(recs, mine_ids, outs, self.policy.tokenizer)
            responses = [o.token_ids for o in outs]
            if vl:  # a sampled image/video token cannot be teacher-forced: the answer ends before it
                responses = [vision_safe_response(r, self.vision_token_ids) for r in responses]
            # A format in resized-image pixels (Qwen2.5-VL's) is bound to each record's image size.
            sizes = ([v.image_size(patch_size(self.policy.processor)) for v in vision]
                     if vl and self.core.fmt.needs_image_size else None)
            recipe = self.core.recipe
            segments, stats = build_segments(
                recs, mine_ids, [o.prompt_token_ids for o in outs], responses, self.policy.vocab,
                self.core.matching, self.core.targets, fmt=self.core.fmt, image_sizes=sizes,
                clean=recipe.clean, duplicates=recipe.duplicates, explorer_ids=explorers,
            )
            if vl:  # pixels and per-segment M-RoPE positions for the packed forward
                segments = [with_vision(self.model, seg, v) for seg, v in zip(segments, vision, strict=True)]
            self._add_phase("parse", stats.parse_s)
            self._add_phase("match", stats.match_s)
            self._add_phase("targets", stats.targets_s)
            with self._phase("pack"):
                self.packer.add(segments)
                rows = []
                for _ in range(self.cfg.grad_accumulation):
                    row = self.packer.next_row()
                    if row is None:
                        break
                    rows.append(row)
        if ranks.enabled:  # F1 and the counters are over the global batch
            totals = ranks.sum([getattr(stats, f) for f in _COUNTS])
            for f, v in zip(_COUNTS, totals, strict=True):
                setattr(stats, f, int(v))
        if ranks.is_main:
            m.OBJECTS.labels("matched").inc(stats.matched)
            m.OBJECTS.labels("fp").inc(stats.false_positives)
            m.OBJECTS.labels("fn").inc(stats.false_negatives)
            m.DROPPED_OBJECTS.inc(stats.dropped)
            m.TRUNCATED_ROLLOUTS.inc(stats.truncated)
        m.BUFFER_SEGMENTS.set(self.packer.pending)
        return _Built(rows, stats, everything if ranks.is_main else outs, [r.id for r in recs],
                      "B" if channel_b else "A")

    def _channel_a_rollouts(self, batch: tuple[int, ...]) -> tuple[list[Rollout], list[Rollout] | None, None]:
        """Channel A (the warm start's steps too): no generation; an empty answer makes the targets the whole ground
        truth. This rank's share, and the whole batch's on rank 0."""
        everything = None
        if self.ranks.is_main:
            st = self.state
            reason = "warm_start" if st.step < self.cfg.warm_start_steps else "channel_a"
            everything = [Rollout(self.records[idx].id, self._prompt_ids(idx), [], reason, st.version, "",
                                  weight_run_id=st.run_id) for idx in batch]
        return self._scatter(everything, len(batch)), everything, None

    def _channel_b_rollouts(self, k: int) -> tuple[list[Rollout], list[Rollout] | None, list | None]:
        """Channel B: E-step `k`'s own answers (the anchors) from the rollout source, and with recipe generation 2
        the explorers' answers per prompt."""
        outs, everything = self._rollouts_for(k, self.core.sampling)
        explorers = self._explorer_rollouts(k) if self.core.recipe.explorers else None
        return outs, everything, explorers

    # -- M-step ---------------------------------------------------------------------------------
    def _m_step(self, rows: list[PackedRow]) -> tuple[float, dict[str, float], int, float]:
        """One optimizer step on this step's rows; the loss is the token-level mean over all rows
        of all ranks (same as one big packed row). Returns the loss, its parts, the number of rows
        over all ranks and their mean fill."""
        # The denominators of the step's means (positions, or weights with loss.normalization weighted), over every
        # row of every rank.
        per_row = [row_totals(r, self.core.weights.weighted_mean) for r in rows]
        ce_total, coord_total, box_total, ul_total, n_rows, fill_sum = self.ranks.sum([
            *(sum(t[i] for t in per_row) for i in range(4)), len(rows), sum(r.fill for r in rows),
        ])
        if not n_rows:
            raise RuntimeError("packer produced no row for this step (empty rollouts and carry buffer)")
        lr = learning_rate(self.cfg, self.state.step)
        with self.ranks.guard("forward/backward"):
            sums = self.device_step(rows, ce_total, coord_total, lr, box_total, ul_total)
        # The only host reads of the step: after it, once.
        total = self.ranks.sum([float(sums[k]) for k in ("loss", *_PARTS)])
        return total[0], dict(zip(_PARTS, total[1:], strict=True)), int(n_rows), fill_sum / n_rows

    def device_step(self, rows: list[PackedRow], ce_total: float, coord_total: float, lr: float,
                    box_total: float = 0, ul_total: float = 0) -> dict[str, torch.Tensor]:
        """Forward/backward of every row on the training device, then the optimizer step. Returns
        the loss and its parts summed over the rows, as tensors on the device (no host reads, so
        it runs with the parameters on `meta`)."""
        coord_ids, weights = self.policy.vocab.coord_token_ids, self.core.weights

        def row_loss(row: PackedRow, logits: torch.Tensor, _: None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            s = loss_sums(logits, row, coord_ids, weights.sigma)
            # Normalised by the step's global totals: summing rows' losses gives the pooled mean.
            out = s.normalised_by(ce_total, coord_total, box_total, ul_total).finish(weights)
            return out.loss, {k: out.parts[k] for k in _PARTS}

        return self._optimize(rows, lr, row_loss)

    # -- reporting ------------------------------------------------------------------------------
    def _step_metrics(self, r: StepResult) -> None:
        for k, v in r.parts.items():
            m.LOSS.labels(k).set(v)

    def _step_line(self, r: StepResult) -> str:
        f1 = f"{r.stats.f1:.3f}" if r.stats and r.channel == "B" else ("reuse" if r.channel == "B" else "- (A)")
        return (f"step {r.step} v{r.weight_version} loss {r.loss:.4f} (ce {r.parts.get('ce', 0.0):.4f} "
                f"coord {r.parts.get('coord', 0.0):.4f}) f1 {f1} rows {r.rows} fill {r.fill:.3f} {r.seconds:.2f}s")
