"""Docs that name the code's words stay tied to them: every reason a job can fail to start with
(rmsft_operator.failures.STARTUP_FAILURES) has its row in docs/troubleshooting.md, and the spec reference says
when weights sync as the loop does it (issue 44: both had drifted)."""

from __future__ import annotations

import re
from pathlib import Path

from rmsft_operator.failures import STARTUP_FAILURES

ROOT = Path(__file__).resolve().parents[1]


def test_every_startup_failure_reason_has_its_row_in_troubleshooting() -> None:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("|")]
    named = {reason for reason in STARTUP_FAILURES for row in rows if re.search(rf"`{reason}`", row.split("|")[1])}
    assert named == set(STARTUP_FAILURES), sorted(set(STARTUP_FAILURES) - named)


def test_the_spec_reference_says_weights_sync_before_sampling_steps_not_after_every_step() -> None:
    from rmsft.jobspec.sync import SyncSpec

    for where in ((ROOT / "docs" / "spec-reference.md").read_text(), SyncSpec.__doc__ or ""):
        assert "after every optimizer step" not in where
        assert "before each step that samples" in " ".join(where.split())
