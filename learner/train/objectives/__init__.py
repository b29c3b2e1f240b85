"""Training objectives: what one optimizer step of the loop trains on, and its loss.

- `base`: the interface (`Objective`, `StepPlan`, `Built`) and how the loop runs it.
- `rollout_matching`: rollout-matching SFT (`spec.trainer: rollout_matching`; channel A: the ground truth,
  channel B: the model's own answers, matched and completed).
- `grpo`: GRPO (`spec.trainer: grpo`).

A third objective is one module here implementing `Objective` and one line in `OBJECTIVES` (the value
`spec.trainer` names it by); tests/learner/test_objectives.py builds a toy one that way.
"""

from __future__ import annotations

from learner.train.objectives.base import Built, Objective, StepPlan
from learner.train.objectives.grpo import Grpo
from learner.train.objectives.rollout_matching import RolloutMatching
from rmsft.jobspec import RolloutMatchingJob

__all__ = ["OBJECTIVES", "Built", "Grpo", "Objective", "RolloutMatching", "StepPlan", "objective_for"]

OBJECTIVES: dict[str, type[Objective]] = {
    RolloutMatching.name: RolloutMatching,
    Grpo.name: Grpo,
}


def objective_for(job: RolloutMatchingJob) -> Objective:
    """The objective `spec.trainer` names, built for the job (what can fail, e.g. a reward's name, fails now)."""
    try:
        cls = OBJECTIVES[job.spec.trainer]
    except KeyError:
        raise ValueError(f"spec.trainer {job.spec.trainer!r} names no objective (known: "
                         f"{', '.join(sorted(OBJECTIVES))})") from None
    return cls(job)
