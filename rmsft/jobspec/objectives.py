"""The registry of training objectives: the values `spec.trainer` takes, each naming the class that implements it.

The one list of them: the spec accepts exactly these names, the CRD's enum of spec.trainer is generated from them
(rmsft_operator.crd), and the learner builds the objective from its entry (`learner.train.objectives.objective_for`).
An entry is an import path ("package.module:Class", an `learner.train.objectives.base.Objective`) rather than the
class: this package is torch-free (the operator imports it), the objectives are not.

A third objective is one module implementing `Objective` and one line here (docs/architecture.md, "Adding an
objective"); regenerate the CRD after (`python -m rmsft_operator.crd > charts/rmsft/crds/rolloutmatchingjobs.yaml`).
"""

from __future__ import annotations

__all__ = ["DEFAULT_OBJECTIVE", "OBJECTIVES"]

OBJECTIVES: dict[str, str] = {
    "rollout_matching": "learner.train.objectives.rollout_matching:RolloutMatching",  # rollout-matching SFT
    "grpo": "learner.train.objectives.grpo:Grpo",  # GRPO (spec.training.grpo)
}

DEFAULT_OBJECTIVE = "rollout_matching"
