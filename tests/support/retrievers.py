"""In-memory retrievers: a deterministic keyword retriever that counts its calls, one that
fails like a dead server, and passages in several scripts."""

from __future__ import annotations

from typing import Sequence

from stppo_envs.retrieval import Hit, RetrievalError

PASSAGES = [("München", "München liegt an der Isar. 東京は日本の首都です。"),
            ("Zürich", "Zürich 🚀 café naïve façade.")]


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
