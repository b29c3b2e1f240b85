"""One level-triggered reconcile pass over a RolloutMatchingJob: observe -> decide -> act.

Every trigger (create/update/resume of the job, an event on a child StatefulSet or Job, the
periodic resync) runs the same pass:

- `observe` reads what exists: the job, its children, its pods, pod-creation failures and the
  learner's progress. Only reads.
- `decide` is a pure function of what was observed: which children to create, which to patch
  (scale the pool, resume the learner, refresh the server list) and the status to report. It is
  table-tested without any API (tests/operator/test_operator_decide.py). Why a job cannot go on (a
  stuck pod, a failed preflight, a crash loop, the startup deadline) is read from its pods by `failures`.
- `act` carries the decision out; every action is idempotent, so a pass interrupted by an API error
  is simply run again. The status is written only when it changed (every write is a watch event
  for every client).
"""

from __future__ import annotations

from typing import Any

from rmsft_operator.act import FORBIDDEN, INVALID_OBJECT, Outcome, act, refused_create
from rmsft_operator.clocks import PSA_ENFORCE_LABEL, SHARED_MEMORY_FORBIDDEN, shared_memory_refusal
from rmsft_operator.decide import decide
from rmsft_operator.decision import MESSAGE_LIMIT, Decision, Delete, Patch, fit_message, now_rfc3339
from rmsft_operator.kube import Kube
from rmsft_operator.observe import CHILD_KINDS, Observed, api_kind, observe, owned_by, secret_stand_in

# What callers (handlers, tests) name through this module: the stages' own modules hold them.
__all__ = [
    "CHILD_KINDS",
    "FORBIDDEN",
    "INVALID_OBJECT",
    "MESSAGE_LIMIT",
    "PSA_ENFORCE_LABEL",
    "SHARED_MEMORY_FORBIDDEN",
    "Decision",
    "Delete",
    "Observed",
    "Outcome",
    "Patch",
    "act",
    "api_kind",
    "decide",
    "fit_message",
    "now_rfc3339",
    "observe",
    "owned_by",
    "reconcile",
    "refused_create",
    "secret_stand_in",
    "shared_memory_refusal",
]


def reconcile(kube: Kube, body: dict[str, Any], progress_timeout: float = 0.0) -> Outcome:
    obs = observe(kube, body, progress_timeout)
    return act(kube, obs, decide(obs, now_rfc3339()))
