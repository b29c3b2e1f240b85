"""A tier that cannot run is a skip on a developer's machine and a failure in CI (tests/tiers.py)."""

from __future__ import annotations

import pytest
from tiers import in_ci, unavailable


@pytest.mark.parametrize("value", ["true", "TRUE", "1", "yes"])
def test_in_ci_a_missing_tier_fails_with_its_reason(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    assert in_ci()
    with pytest.raises(pytest.fail.Exception, match=r"the cluster tier cannot run here, and CI must run it: no helm"):
        unavailable("cluster", "no helm")


@pytest.mark.parametrize("value", [None, "", "false", "0"])
def test_elsewhere_a_missing_tier_is_skipped_with_its_reason(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not in_ci()
    with pytest.raises(pytest.skip.Exception, match=r"^no helm$"):
        unavailable("cluster", "no helm")
