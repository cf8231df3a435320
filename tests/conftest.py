"""Shared fixtures: where the real benchmark slices live, and in-memory retriever test doubles."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import pytest

from stppo_envs.retrieval import Hit, RetrievalError

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path | None:
    """``$STPPO_SHARED_DATA`` or ``../shared/data`` beside the checkout (where CI puts the fixture pack)."""
    candidates = [os.environ.get("STPPO_SHARED_DATA"), REPO.parent / "shared" / "data"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "README.md").exists():
            return Path(candidate)
    return None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have the real-data fixture pack at ../shared/data or $STPPO_SHARED_DATA")
        pytest.skip("real-data fixture pack not found (set STPPO_SHARED_DATA)")
    return path


class KeywordRetriever:
    """A deterministic in-memory retriever: passages ranked by shared lower-case words. Counts its calls."""

    def __init__(self, passages: Sequence[tuple[str, str]] = (("Paris", "Paris is the capital of France."),)):
        self.passages = list(passages)
        self.batch_calls: list[list[str]] = []

    def search(self, query: str, k: int = 10) -> list[Hit]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries, k=10):
        self.batch_calls.append(list(queries))
        out = []
        for query in queries:
            words = set(query.lower().split())
            scored = sorted(((len(words & set((t + " " + x).lower().split())), i) for i, (t, x) in
                             enumerate(self.passages)), reverse=True)[:k]
            out.append([Hit(str(i), float(s), *self.passages[i]) for s, i in scored])
        return out


class FailingRetriever:
    """Every search fails the way a dead retrieval server does."""

    def search(self, query, k=10):
        raise RetrievalError("retrieval server at http://127.0.0.1:9 is down")

    def batch_search(self, queries, k=10):
        raise RetrievalError("retrieval server at http://127.0.0.1:9 is down")


@pytest.fixture
def keyword_retriever() -> KeywordRetriever:
    return KeywordRetriever()
