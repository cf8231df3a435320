"""A scripted backend behind the retrieval server under test."""

from __future__ import annotations

from stppo_envs.retrieval import Hit

# --- the batcher -------------------------------------------------------------------------------------------------

class _Backend:
    """Rows that name their query and k; records every call."""

    def __init__(self):
        self.calls: list[tuple[list[str], int]] = []

    def batch_search(self, queries, k=10):
        self.calls.append((list(queries), k))
        return [[Hit(f"{q}#{j}", float(k - j), q, "") for j in range(k)] for q in queries]

    def search(self, query, k=10):
        return self.batch_search([query], k)[0]
