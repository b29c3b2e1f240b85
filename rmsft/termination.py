"""The line a finished learner leaves as its container's termination message, and how the operator reads it.

The operator follows training through the learner pod's /metrics endpoint, which dies with the process: the
last steps of a run fall between two reads. The kubelet keeps a container's termination message in the pod's
status after it exited, so the learner writes its final step there and `status.step` of a Complete job is exact.
Torch-free: the operator image imports it."""

from __future__ import annotations

import re

_FINAL = re.compile(r"rmsft train: finished at step (\d+), weight version (\d+)")


def final_progress_message(step: int, weight_version: int) -> str:
    return f"rmsft train: finished at step {step}, weight version {weight_version}"


def parse_final_progress(message: str) -> dict[str, int]:
    """{"step", "weightVersion"} of the last final-progress line in `message`; {} when there is none (a failed
    learner's message is its log tail, which carries none)."""
    found = _FINAL.findall(message or "")
    if not found:
        return {}
    step, version = found[-1]
    return {"step": int(step), "weightVersion": int(version)}
