"""Where the checkout is, for tests that read its files or run its scripts."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
