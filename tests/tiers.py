"""A tier that cannot run on this machine (no Docker engine, no envtest binaries, no helm): skipped on a
developer's machine, with the reason, and a failure in CI. CI installs everything each tier needs (`make setup`),
so a tier missing there means a broken setup, and a skip would let the run go green while testing less."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    """CI sets CI=true (GitHub Actions, GitLab, this project's `.ci/run` callers); 1/yes count too."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(tier: str, reason: str) -> NoReturn:
    if in_ci():
        pytest.fail(f"the {tier} tier cannot run here, and CI must run it: {reason}", pytrace=False)
    pytest.skip(reason)
