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


def test_the_readme_reaches_try_it_quickly_and_stays_short() -> None:
    """A newcomer reads what rmsft is and how to try it before any study figure (issue 65): the front page up to
    "Try it" stays under 250 words, the whole page under 2,000; the measured part is a few sentences and one table
    after "Try it", its details in docs/benchmarks.md and studies/method/."""
    text = (ROOT / "README.md").read_text()
    head, sep, _ = text.partition("## Try it")
    assert sep, "README.md has no 'Try it' section"
    assert len(head.split()) < 250, len(head.split())
    assert len(text.split()) < 2000, len(text.split())
    assert text.index("## Measured") > text.index("## Try it")
    assert "studies/method/" in text


def test_the_method_study_keeps_its_ledgers_beside_it() -> None:
    """The research grid lives in studies/method/ with its ledgers; benchmarks/ and docs/img hold the product's."""
    study = ROOT / "studies" / "method"
    assert (study / "method_compare.py").is_file() and (study / "README.md").is_file()
    assert sorted(p.name for p in (study / "results").glob("method_compare*.csv"))
    assert not sorted((ROOT / "docs" / "img").glob("method_compare*"))
    assert not sorted((ROOT / "benchmarks").glob("method_compare*.py"))
