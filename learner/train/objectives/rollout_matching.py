"""Rollout-matching SFT, the objective of `spec.trainer: rollout_matching`.

One step (`build`, then the loop's update with `row_loss`):

    E-step   the step's rollouts, by the recipe's channel:
               channel A  no generation: an empty answer makes the targets the whole ground truth (the warm start's
                          steps are channel A too)
               channel B  the model's own answers (the anchor, plus explorers with recipe generation 2), from the
                          rollout feed within the staleness window (`learner.train.feed`)
             then parse -> match -> targets -> segments (`learner.data.episode.build_segments`) -> packed rows.
             With the rollout buffer on, one E-step feeds `m_steps` optimizer steps.
    M-step   forward, loss, backward, optimizer on the packed rows (the loop's): the token-level mean over every
             row of every rank, same as one big packed row.

Weights are synced only before an E-step that samples (and once before the first), never per M-step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from learner.core.format_watch import FormatWatch
from learner.core.head import RowHead
from learner.core.losses import loss_sums, row_totals
from learner.core.packing import PackedRow, Packer
from learner.data.episode import build_segments, check_rollout_prompts
from learner.data.vision import patch_size, with_vision
from learner.rollouts.client import Rollout
from learner.tracking import metrics as m
from learner.train.config import core_configs
from learner.train.feed import EXPLORER_SEED_OFFSET
from learner.train.objectives.base import Built, Objective, Prepare, RowLoss, StepOutcome, StepPlan
from learner.train.results import RolloutMatchingFigures, StepResult
from rmsft import pause_points
from rmsft.jobspec import RolloutMatchingJob

__all__ = ["RolloutMatching"]

log = logging.getLogger("rmsft.learner")

_PARTS = ("ce", "soft_ce", "w1", "gate", "coord", "geo", "ul")
_COUNTS = (
    "rollouts",
    "matched",
    "false_positives",
    "false_negatives",
    "dropped",
    "truncated",
    "response_tokens",
    "predicted",
    "gt_objects",
    "duplicates",
    "dead",
    "recovered",
    "fallback",
)


class RolloutMatching(Objective):
    """Rollout-matching SFT (module doc)."""

    name = "rollout_matching"
    loss_keys = ("loss", *_PARTS)
    chunked_logits = True  # loss_sums takes a RowHead

    def __init__(self, job: RolloutMatchingJob) -> None:
        super().__init__(job)
        self.core = core_configs(self.cfg)
        self._e_step_built: tuple[int, Built] | None = None  # the E-step whose rows its later M-steps reuse
        self._format_watch: FormatWatch | None = None  # rank 0: rollouts that parse to nothing (format_watch.py)

    def make_packer(self) -> Packer:
        return Packer(*self.core.packing)

    # -- the schedule ---------------------------------------------------------------------------------
    def e_step_samples(self, k: int) -> bool:
        """E-step `k` is rollout matching (channel B): after the warm start, on the recipe's schedule (generation 1:
        every step); the others teach the ground truth (channel A: no generation, no sync before them)."""
        m_steps = self.core.m_steps
        first = -(-self.cfg.warm_start_steps // m_steps)  # the first E-step after the warm start
        return k * m_steps >= self.cfg.warm_start_steps and self.core.recipe.channel_b(k - first)

    def needs_rollouts(self) -> str | None:
        if self.cfg.warm_start_steps >= self.cfg.steps:
            return None  # every step teaches the ground truth (e.g. rmsft local's pretraining)
        return (
            "training.warm_start_steps < training.steps: the steps after the warm start sample (only a run whose "
            "every step is a warm-start step runs without servers)"
        )

    def plan(self, step: int) -> StepPlan:
        k, m_steps = divmod(step, self.core.m_steps)
        builds = m_steps == 0
        return StepPlan(
            step=step,
            e_step=k,
            batch=self.inputs.order.batch(k),
            builds=builds,
            samples=builds and self.e_step_samples(k),
        )

    def _sampling_e_steps_after(self, k: int) -> Iterator[int]:
        """The run's later E-steps that sample, in order (lazily: the feed takes the first `max_staleness`)."""
        last = -(-self.cfg.steps // self.core.m_steps)
        return (j for j in range(k + 1, last) if self.e_step_samples(j))

    # -- E-step ---------------------------------------------------------------------------------------
    def build(self, plan: StepPlan) -> Built:
        """The step's rows: built at the start of an E-step, reused by its later M-steps (a checkpoint between them
        keeps them: `state_dict`). Rows that are missing all the same (a checkpoint written without them) are built
        again, from new rollouts."""
        kept = self._e_step_built
        if not plan.builds and kept is not None and kept[0] == plan.e_step:
            return Built(kept[1].rows, kept[1].local_ids, {**kept[1].extra, "fresh": False})
        if not plan.builds:
            log.warning(
                "step %d is inside E-step %d, whose rows neither this process nor its checkpoint holds: "
                "building them again from new rollouts",
                plan.step + 1,
                plan.e_step,
            )
        built = self._e_step(plan)
        self._e_step_built = (plan.e_step, built)
        return built

    def state_dict(self) -> dict[str, Any]:
        """Between an E-step's M-steps, this rank's rows of that E-step (what its later M-steps train on again)."""
        kept, step = self._e_step_built, self.inputs.state.step
        if kept is None or self.plan(step).builds or kept[0] != step // self.core.m_steps:
            return {}
        built = kept[1]
        return {"e_step": kept[0], "rows": built.rows, "local_ids": built.local_ids, "channel": built.extra["channel"]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._e_step_built = None
        if saved:
            self._e_step_built = (
                saved["e_step"],
                Built(
                    list(saved["rows"]),
                    list(saved["local_ids"]),
                    {"channel": saved["channel"], "rollouts": [], "stats": None, "fresh": False},
                ),
            )

    def _e_step(self, plan: StepPlan) -> Built:
        """This rank's share of the E-step's rollouts (by its channel), built into segments and packed into rows."""
        inp, feed, ranks, core = self.inputs, self.inputs.feed, self.inputs.ranks, self.core
        feed.new_e_step()
        k, batch = plan.e_step, plan.batch
        channel_b = self.e_step_samples(k)
        explorers = None
        with inp.phases.time("rollout"):
            if channel_b:  # the model's own answers (anchors), and with recipe generation 2 its explorers'
                outs, everything = feed.rollouts(k, core.sampling, upcoming=self._sampling_e_steps_after(k))
                if core.recipe.explorers:
                    explorers = self._explorers(k)
            else:  # no generation: an empty answer makes the targets the whole ground truth
                everything = None
                if ranks.is_main:
                    st = inp.state
                    reason = "warm_start" if plan.step < self.cfg.warm_start_steps else "channel_a"
                    everything = [
                        Rollout(
                            inp.records[i].id, feed.prompt_ids(i), [], reason, st.version, "", weight_run_id=st.run_id
                        )
                        for i in batch
                    ]
                outs = feed.scatter(everything, len(batch))
        lo, hi = ranks.share(len(batch))
        mine = batch[lo:hi]
        policy = inp.policy
        with ranks.guard("building training segments"):
            pause_points.fail_at("step", inp.state.step + 1)  # tests: one rank failing mid-run (rmsft.pause_points)
            if len(outs) != len(mine) or not feed.within_window(outs):
                raise RuntimeError(
                    f"rank {ranks.rank} got {len(outs)} rollout(s) for {len(mine)} prompt(s) "
                    f"or a weight version outside {inp.state.weights} minus max_staleness "
                    f"{self.cfg.rollout.max_staleness}"
                )
            recs = [inp.records[i] for i in mine]
            vl = policy.is_vision_language
            vision = [feed.vision_prompt(i) for i in mine] if vl else []
            mine_ids = [v.input_ids for v in vision] if vl else [feed.text_prompt(i) for i in mine]
            check_rollout_prompts(recs, mine_ids, outs, policy.tokenizer)
            # A format in resized-image pixels (Qwen2.5-VL's) is bound to each record's image size.
            sizes = (
                [v.image_size(patch_size(policy.processor)) for v in vision]
                if vl and core.fmt.needs_image_size
                else None
            )
            responses = feed.trainable_responses(outs)
            segments, stats = build_segments(
                recs,
                mine_ids,
                [o.prompt_token_ids for o in outs],
                responses,
                policy.vocab,
                core.matching,
                core.targets,
                fmt=core.fmt,
                image_sizes=sizes,
                clean=core.recipe.clean,
                duplicates=core.recipe.duplicates,
                explorer_ids=explorers,
            )
            if channel_b and ranks.is_main:  # answers in another format parse to nothing: say so, once
                if self._format_watch is None:
                    self._format_watch = FormatWatch(core.fmt, policy.vocab)
                self._format_watch.observe(responses, stats.predicted, stats.gt_objects)
            if vl:  # pixels and per-segment M-RoPE positions for the packed forward
                segments = [with_vision(inp.model, seg, v) for seg, v in zip(segments, vision, strict=True)]
            inp.phases.add("parse", stats.parse_s)
            inp.phases.add("match", stats.match_s)
            inp.phases.add("targets", stats.targets_s)
            with inp.phases.time("pack"):
                inp.packer.add(segments)
                rows = []
                for _ in range(self.cfg.grad_accumulation):
                    row = inp.packer.next_row()
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
        m.PACKER_PENDING.set(inp.packer.pending)
        return Built(
            rows,
            [r.id for r in recs],
            {
                "rollouts": everything if ranks.is_main else outs,
                "stats": stats,
                "channel": "B" if channel_b else "A",
                "fresh": True,
            },
        )

    def _explorers(self, k: int) -> list[list[list[int]]]:
        """Recipe generation 2, a B step: this rank's prompts' explorer answers (`explorers` sampled completions per
        prompt, seeded apart from the anchors), grouped per prompt. A Generate call of their own: with rollouts
        generated ahead there are no explorers (the spec refuses them), so no other call is in flight."""
        recipe, feed = self.core.recipe, self.inputs.feed
        n = recipe.explorers
        mine, _ = feed.rollouts(k, recipe.explorer_sampling, n=n, seed_offset=EXPLORER_SEED_OFFSET, gather=False)
        if not feed.within_window(mine):
            raise RuntimeError(f"explorer rollouts from a weight version other than {self.inputs.state.weights}")
        responses = feed.trainable_responses(mine)
        return [responses[i * n : (i + 1) * n] for i in range(len(responses) // n)]

    # -- M-step ---------------------------------------------------------------------------------------
    def denominators(self, built: Built) -> list[float]:
        """The step's means' denominators on this rank: positions (or weights, with loss.normalization weighted) of
        the CE, coordinate, box and unlikelihood terms."""
        per_row = [row_totals(r, self.core.weights.weighted_mean) for r in built.rows]
        return [sum(t[i] for t in per_row) for i in range(4)]

    def row_loss(self, built: Built, totals: Sequence[float]) -> tuple[RowLoss, Prepare | None]:
        ce_total, coord_total, box_total, ul_total = totals
        coord_ids, weights = self.inputs.policy.vocab.coord_token_ids, self.core.weights

        def row_loss(
            row: PackedRow, logits: torch.Tensor | RowHead, _: None
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            s = loss_sums(logits, row, coord_ids, weights.sigma)
            # Normalised by the step's global totals: summing rows' losses gives the pooled mean.
            out = s.normalised_by(ce_total, coord_total, box_total, ul_total).finish(weights)
            return out.loss, {k: out.parts[k] for k in _PARTS}

        return row_loss, None

    def outcome(self, built: Built, sums: Mapping[str, float]) -> StepOutcome:
        fresh = built.extra["fresh"]
        stats = built.extra["stats"] if fresh else None
        return StepOutcome(
            rollouts=built.extra["rollouts"] if fresh else [],
            parts={k: sums[k] for k in _PARTS},
            figures=RolloutMatchingFigures(built.extra["channel"], stats),
        )

    # -- reporting ------------------------------------------------------------------------------------
    def line(self, r: StepResult) -> str:
        fig = r.figures
        assert isinstance(fig, RolloutMatchingFigures), "a rollout-matching step's figures (outcome())"
        f1 = f"{fig.stats.f1:.3f}" if fig.sampled and fig.stats else ("reuse" if fig.channel == "B" else "- (A)")
        # Six decimals: two runs that should train alike (one pod of two ranks, two pods of one) are compared from
        # these lines to 1e-4 (tests/cluster: their thread counts differ, so their sums do); the progress bars round.
        return (
            f"step {r.step} v{r.weight_version} loss {r.loss:.6f} (ce {r.parts.get('ce', 0.0):.6f} "
            f"coord {r.parts.get('coord', 0.0):.6f}) f1 {f1} rows {r.rows} fill {r.fill:.3f} {r.seconds:.2f}s"
        )
