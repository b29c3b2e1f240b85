"""Training progress for `status.step` / `status.weightVersion` (the STEP printer column) and
`status.evaluation` (the last held-out evaluation: its step, F1, mAP, mAP50), read from the learner pod's
own /metrics endpoint while it runs, and from its termination message once it finished (the endpoint is
gone by then; rmsft.termination): the learner needs no API rights to report it."""

from __future__ import annotations

import logging
import math
import re
import urllib.request
from typing import Any

from rmsft.termination import parse_final_progress
from rmsft_operator.render import COMPLETION_INDEX_ANNOTATION

log = logging.getLogger("rmsft_operator.progress")
_SERIES = {"step": "rmsft_learner_global_step", "weightVersion": "rmsft_learner_weight_version"}
# status.evaluation key -> learner gauge (learner/tracking/metrics.py). The gauges start at 0: an eval step below 1
# means no evaluation yet, and then there is no status.evaluation at all.
EVAL_SERIES = {
    "step": "rmsft_learner_eval_step",
    "f1": "rmsft_learner_eval_f1",
    "mAP": "rmsft_learner_eval_map",
    "mAP50": "rmsft_learner_eval_map50",
}
EVAL_DIGITS = 4  # status figures are read by people (printer columns); more digits only churn the status


def _sample(text: str, name: str) -> float | None:
    """The value of the unlabelled-or-labelled sample `name`, None when absent or not finite (NaN: e.g.
    mAP of a held-out set without ground truth; the API server cannot store NaN)."""
    m = re.search(rf"^{name}(?:\{{[^}}]*\}})?\s+(\S+)\s*$", text, flags=re.M)
    if not m:
        return None
    try:
        value = float(m.group(1))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_progress(text: str) -> dict[str, Any]:
    """`step` and `weightVersion` (ints, when reported and >= 0) and, once the learner has evaluated,
    `evaluation`: {step: int, f1, mAP, mAP50: floats in [0, 1] rounded to 4 digits, each when finite}."""
    out: dict[str, Any] = {}
    for key, name in _SERIES.items():
        value = _sample(text, name)
        if value is not None and value >= 0:
            out[key] = int(value)
    eval_step = _sample(text, EVAL_SERIES["step"])
    if eval_step is not None and eval_step >= 1:
        evaluation: dict[str, Any] = {"step": int(eval_step)}
        for key, name in EVAL_SERIES.items():
            value = _sample(text, name)
            if key != "step" and value is not None and 0.0 <= value <= 1.0:
                evaluation[key] = round(value, EVAL_DIGITS)
        out["evaluation"] = evaluation
    return out


def completion_index(pod: dict[str, Any]) -> int:
    """The pod's index in an Indexed Job (learner.nodes > 1; 0 for the one pod of any other job)."""
    value = ((pod.get("metadata") or {}).get("annotations") or {}).get(COMPLETION_INDEX_ANNOTATION)
    return int(value) if value is not None and str(value).isdigit() else 0


def learner_progress(pods: list[dict[str, Any]], port: int, timeout: float) -> dict[str, Any]:
    """Progress from the first running learner pod that answers, pod 0 first (its rank 0 is the one that reports
    evaluations); {} when none does."""
    for pod in sorted(pods, key=completion_index):
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if status.get("phase") != "Running" or not ip:
            continue
        host = f"[{ip}]" if ":" in ip else ip
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as resp:
                return parse_progress(resp.read().decode("utf-8", "replace"))
        except (OSError, ValueError) as exc:  # not up yet, restarted, network policy...
            log.debug("no progress from %s: %s", pod.get("metadata", {}).get("name"), exc)
    return {}


def learner_final_progress(pods: list[dict[str, Any]]) -> dict[str, int]:
    """The highest final step (and its weight version) any finished learner container wrote as its termination
    message; {} when none did (still running, failed, or an image that predates the message)."""
    best: dict[str, int] = {}
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            done = (cs.get("state") or {}).get("terminated") or {}
            found = parse_final_progress(done.get("message") or "")
            if found and found["step"] >= best.get("step", -1):
                best = found
    return best
