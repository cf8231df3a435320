"""Tests of the bridges to verl and TRL, which are not dependencies of the project: without the framework such a
test module (or test) is skipped; in the venv that installs it (``make test-verl``, ``make test-trl``) its variable
turns the skip into a failure, so a broken install cannot pass as a skipped suite."""

from __future__ import annotations

import importlib
import os

import pytest

VERL_REASON = "the verl bridge needs verl 0.9 (docs/verl.md)"
TRL_REASON = "the TRL adapter needs TRL (docs/trl.md, `pip install .[trl]`)"


def require_or_skip(module: str, variable: str, reason: str):
    """``module`` imported; a skip saying ``reason`` without it, unless ``$variable`` is set (to anything but ``0``):
    then its ImportError fails the caller. At module level it skips the whole file."""
    if os.environ.get(variable, "") not in ("", "0"):
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=reason)


def require_verl(reason: str = VERL_REASON):
    """verl, or a skip (an error under ``STPPO_REQUIRE_VERL=1``)."""
    return require_or_skip("verl", "STPPO_REQUIRE_VERL", reason)


def require_trl(reason: str = TRL_REASON):
    """TRL, or a skip (an error under ``STPPO_REQUIRE_TRL=1``)."""
    return require_or_skip("trl", "STPPO_REQUIRE_TRL", reason)
