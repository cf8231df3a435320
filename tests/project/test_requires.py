"""tests/support/requires.py: a framework the project does not depend on skips the tests that need it, unless the
venv that installs it says it is required -- then its absence is an error, not a quiet skip."""

from __future__ import annotations

import pytest

from tests.support.requires import require_or_skip

MISSING = "stppo_no_such_framework"


def test_a_missing_framework_skips_with_the_reason(monkeypatch):
    monkeypatch.delenv("STPPO_REQUIRE_NOTHING", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs the framework"):
        require_or_skip(MISSING, "STPPO_REQUIRE_NOTHING", "needs the framework")


@pytest.mark.parametrize("value", ["1", "true"])
def test_a_required_framework_that_is_missing_fails(monkeypatch, value):
    monkeypatch.setenv("STPPO_REQUIRE_NOTHING", value)
    with pytest.raises(ImportError):
        require_or_skip(MISSING, "STPPO_REQUIRE_NOTHING", "needs the framework")


def test_a_present_framework_is_returned_either_way(monkeypatch):
    import json

    for value in ("", "0", "1"):
        monkeypatch.setenv("STPPO_REQUIRE_NOTHING", value)
        assert require_or_skip("json", "STPPO_REQUIRE_NOTHING", "unused") is json
