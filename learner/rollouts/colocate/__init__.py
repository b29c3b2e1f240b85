"""The rollout engine inside the learner's ranks (spec.rollout.mode: colocate).

vLLM (or, explicitly, the HF engine) lives in the training process on the training devices and decodes with no
gradients between optimizer steps: no server pool, no weight transport. `ColocatedRollouts` implements the same
rollout interface as the server pool (`learner.rollouts.interface`), so the trainers' loops do not know which one
they drive. Weights go straight from the training model into the engine (merged, layer by layer; no gRPC, no
file), and prompts go through the server's own request path (`rollout_engine.prompts`), so both modes render, seed
and sample alike.

    engine.py     vLLM in this process (its engine core in-process; the external launcher for TP groups on GPUs)
    groups.py     TP groups of learner ranks: gather the group's requests, keep this rank's slice
    rollouts.py   the rollout source: requests -> engine -> fenced completions; weight sync; sleep / wake

The training state's side of sharing the devices (parameters and optimizer state to host memory while the engine
generates) is the training loop's: learner/train/offload.py.
"""

from learner.rollouts.colocate.rollouts import ColocatedRollouts, ColocateError, colocated_rollouts

__all__ = ["ColocateError", "ColocatedRollouts", "colocated_rollouts"]
