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


def _cli_commands() -> list[str]:
    import typer

    from rmsft_cli.app import app

    out: list[str] = []

    def walk(cmd: object, path: list[str]) -> None:
        subs = getattr(cmd, "commands", {})
        if path and not subs:
            out.append(" ".join(path))
        for name, sub in subs.items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return out


def test_every_command_is_in_the_cli_tables_and_the_architecture_list() -> None:
    """Issue 64: `rmsft data check` was in neither docs/cli.md's tables nor docs/architecture.md's list."""
    rows = [line for line in (ROOT / "docs" / "cli.md").read_text().splitlines() if line.startswith("| `rmsft ")]
    listed = {re.match(r"\| `rmsft ([a-z -]+?)(?: [A-Z\[(`-]|`)", row).group(1).strip() for row in rows}
    app_row = next(
        line
        for line in (ROOT / "docs" / "architecture.md").read_text().splitlines()
        if line.startswith("| `rmsft_cli/app.py` |")
    )
    for command in _cli_commands():
        assert command in listed, (command, sorted(listed))
        assert f"`{command}`" in app_row or f"`rmsft {command}`" in app_row, command


def test_the_methods_docs_architecture_names_are_the_codes() -> None:
    """Every `Class.member` docs/architecture.md names is defined on that class (in the source, or a field of that
    message in the protos): `TrainingLoop._rollouts_for` and `._within_window` had moved to `RolloutFeed`."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    names = sorted(set(re.findall(r"`([A-Z][A-Za-z0-9]+)\.(_?[a-z_][A-Za-z0-9_]*)(?:\(\))?`", text)))
    sources = {
        p: p.read_text()
        for d in ("learner", "rmsft", "rmsft_cli", "rollout_svc", "rollout_engine", "operator", "rmsft_dev")
        for p in (ROOT / d).rglob("*.py")
    }
    protos = "\n".join(p.read_text() for p in (ROOT / "protos").rglob("*.proto"))
    missing = []
    for cls, member in names:
        files = [p for p, body in sources.items() if re.search(rf"^\s*class {cls}\b", body, re.M)]
        if files:
            found = any(
                re.search(rf"^\s+(?:async\s+)?def {member}\b|^\s+{member}\s*[:=]", sources[p], re.M) for p in files
            )
        else:  # a protobuf message: the field in its block
            block = re.search(rf"message {cls}\s*\{{(.*?)\n\}}", protos, re.S)
            found = block is not None and re.search(rf"\b{member}\s*=", block.group(1)) is not None
        if not found:
            missing.append(f"{cls}.{member}")
    assert len(names) > 10 and not missing, missing
