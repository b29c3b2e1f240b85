"""A third objective, added the way docs/architecture.md ("Adding an objective") says: this one module, and one
line in `learner.train.objectives.OBJECTIVES` (tests/learner/test_objectives.py adds it for the test).

Prompt language modelling: each step teaches the model the tokens of its batch's prompts (next-token
cross-entropy on every prompt token but the first, the token-level mean over every rank's rows). No rollouts,
so no servers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # torch's own spelling

from learner.core.packing import PackedRow, Packer
from learner.core.targets import IGNORE_INDEX, Segment
from learner.train.objectives import Built, Objective, StepPlan
from learner.train.objectives.base import Prepare, RowLoss
from learner.train.results import StepResult


class PromptLM(Objective):
    name = "prompt_lm"

    def needs_rollouts(self) -> str | None:
        return None

    def make_packer(self) -> Packer:
        return Packer(self.cfg.packing_length, self.cfg.packing_buffer)

    def plan(self, step: int) -> StepPlan:
        return StepPlan(step=step, e_step=step, batch=self.loop.order.batch(step), builds=True, samples=False)

    def build(self, plan: StepPlan) -> Built:
        loop = self.loop
        lo, hi = loop.ranks.share(len(plan.batch))
        mine = plan.batch[lo:hi]
        segments = []
        for i in mine:
            ids = tuple(loop.feed.text_prompt(i))
            segments.append(Segment(ids, (IGNORE_INDEX, *ids[1:]), (), (), prompt_len=1, prefix_len=1))
        loop.packer.add(segments)
        rows = []
        while (row := loop.packer.next_row()) is not None:
            rows.append(row)
        return Built(rows, [loop.records[i].id for i in mine])

    def denominators(self, built: Built) -> list[float]:
        return [float(sum(int((r.labels != IGNORE_INDEX).sum()) for r in built.rows))]

    def row_loss(self, built: Built, totals: Sequence[float]) -> tuple[RowLoss, Prepare | None]:
        (tokens,) = totals

        def row_loss(row: PackedRow, logits: torch.Tensor, _: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            labels = row.labels[0]
            pos = torch.nonzero(labels != IGNORE_INDEX).flatten()
            return F.cross_entropy(logits[0][pos - 1].float(), labels[pos], reduction="sum") / tokens, {}

        return row_loss, None

    def figures(self, plan: StepPlan, built: Built, sums: Mapping[str, float]) -> dict[str, Any]:
        return {"rollouts": [], "parts": {}, "stats": None, "local_record_ids": list(built.local_ids)}

    def line(self, r: StepResult) -> str:
        return f"step {r.step} prompt-lm loss {r.loss:.4f} rows {r.rows}"
