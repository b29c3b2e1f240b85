"""Training objectives: what one optimizer step of the loop trains on, and its loss.

- `base`: the interface (`Objective`, `StepPlan`, `Built`, `ObjectiveInputs`, `StepOutcome`) and how the loop runs it.
- `rollout_matching`: rollout-matching SFT (`spec.trainer: rollout_matching`; channel A: the ground truth,
  channel B: the model's own answers, matched and completed).
- `grpo`: GRPO (`spec.trainer: grpo`).

Which class a `spec.trainer` value names is the registry's (`rmsft.jobspec.objectives.OBJECTIVES`, torch-free: the
spec and the CRD read it too). A third objective is one module implementing `Objective` and one line there;
tests/learner/test_objectives.py adds a toy one that way.
"""

from __future__ import annotations

import importlib

from learner.train.objectives.base import Built, Objective, ObjectiveInputs, StepOutcome, StepPlan
from learner.train.objectives.grpo import Grpo
from learner.train.objectives.rollout_matching import RolloutMatching
from rmsft.jobspec import RolloutMatchingJob
from rmsft.jobspec.objectives import OBJECTIVES

__all__ = [
    "Built",
    "Grpo",
    "Objective",
    "ObjectiveInputs",
    "RolloutMatching",
    "StepOutcome",
    "StepPlan",
    "objective_class",
    "objective_for",
]


def objective_class(name: str) -> type[Objective]:
    """The class the registry entry `name` names, imported (a wrong entry is an error that says which)."""
    try:
        path = OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"spec.trainer {name!r} names no objective (known: {', '.join(sorted(OBJECTIVES))})") from None
    module, _, attr = path.partition(":")
    cls = getattr(importlib.import_module(module), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Objective) and cls.name == name):
        raise TypeError(f"rmsft.jobspec.objectives.OBJECTIVES[{name!r}] = {path!r} is not an Objective named {name!r}")
    return cls


def objective_for(job: RolloutMatchingJob) -> Objective:
    """The objective `spec.trainer` names, built for the job (what can fail, e.g. a reward's name, fails now)."""
    return objective_class(job.spec.trainer)(job)
