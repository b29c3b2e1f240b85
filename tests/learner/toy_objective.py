"""A third objective, added the way docs/architecture.md ("Adding an objective") says: this one module, and one
line in `rmsft.jobspec.objectives.OBJECTIVES` (tests/learner/test_objectives.py adds it for the test).

Prompt language modelling: each step teaches the model the tokens of its batch's prompts (next-token
cross-entropy on every prompt token but the first, the token-level mean over every rank's rows). No rollouts,
so no servers. Its own figure, the step's trained prompt tokens, reaches the progress bar, TensorBoard, /metrics
and the summaries through `StepFigures` alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # torch's own spelling

from learner.core.packing import PackedRow, Packer
from learner.core.targets import IGNORE_INDEX, Segment
from learner.train.objectives import Built, Objective, StepOutcome, StepPlan
from learner.train.objectives.base import Prepare, RowLoss
from learner.train.results import StepFigures, StepResult


@dataclass
class PromptTokens(StepFigures):
    """The toy's figure: the prompt tokens a step trained on, over every rank."""

    tokens: float

    def bar(self) -> str:
        return f"prompt tokens {self.tokens:.0f}"

    def scalars(self) -> dict[str, float]:
        return {"prompt_lm/tokens": self.tokens}

    def series(self) -> dict[str, float]:
        return {"prompt tokens": self.tokens}


class PromptLM(Objective):
    name = "prompt_lm"

    def needs_rollouts(self) -> str | None:
        return None

    def make_packer(self) -> Packer:
        return Packer(self.cfg.packing_length, self.cfg.packing_buffer)

    def plan(self, step: int) -> StepPlan:
        return StepPlan(step=step, e_step=step, batch=self.inputs.order.batch(step), builds=True, samples=False)

    def build(self, plan: StepPlan) -> Built:
        inp = self.inputs
        lo, hi = inp.ranks.share(len(plan.batch))
        mine = plan.batch[lo:hi]
        segments = []
        for i in mine:
            ids = tuple(inp.feed.text_prompt(i))
            segments.append(Segment(ids, (IGNORE_INDEX, *ids[1:]), (), (), prompt_len=1, prefix_len=1))
        inp.packer.add(segments)
        rows = []
        while (row := inp.packer.next_row()) is not None:
            rows.append(row)
        return Built(rows, [inp.records[i].id for i in mine])

    def denominators(self, built: Built) -> list[float]:
        return [float(sum(int((r.labels != IGNORE_INDEX).sum()) for r in built.rows))]

    def row_loss(self, built: Built, totals: Sequence[float]) -> tuple[RowLoss, Prepare | None]:
        (tokens,) = totals

        def row_loss(row: PackedRow, logits: torch.Tensor, _: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            labels = row.labels[0]
            pos = torch.nonzero(labels != IGNORE_INDEX).flatten()
            return F.cross_entropy(logits[0][pos - 1].float(), labels[pos], reduction="sum") / tokens, {}

        return row_loss, None

    def outcome(self, built: Built, sums: Mapping[str, float]) -> StepOutcome:
        (tokens,) = self.inputs.ranks.sum(self.denominators(built))
        return StepOutcome(rollouts=[], figures=PromptTokens(tokens))

    def line(self, r: StepResult) -> str:
        return f"step {r.step} prompt-lm loss {r.loss:.4f} rows {r.rows}"
