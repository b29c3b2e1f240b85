"""Training progress for `status.step` / `status.weightVersion` (the STEP printer column), read
from the learner pod's own /metrics endpoint: the learner needs no API rights to report it."""

from __future__ import annotations

import logging
import re
import urllib.request
from typing import Any

log = logging.getLogger("rmsft_operator.progress")
_SERIES = {"step": "rmsft_learner_global_step", "weightVersion": "rmsft_learner_weight_version"}


def parse_progress(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, name in _SERIES.items():
        m = re.search(rf"^{name}(?:\{{[^}}]*\}})?\s+([-+0-9.eE]+|NaN)\s*$", text, flags=re.M)
        if m and m.group(1) != "NaN":
            value = float(m.group(1))
            if value >= 0:
                out[key] = int(value)
    return out


def learner_progress(pods: list[dict[str, Any]], port: int, timeout: float) -> dict[str, int]:
    """Progress from the first running learner pod that answers; {} when none does."""
    for pod in pods:
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
