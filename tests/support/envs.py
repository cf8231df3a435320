"""In-memory retrievers and small envs of the env and vector-env tests."""

from __future__ import annotations

from stppo_envs import SearchQAEnv
from tests.support.retrievers import KeywordRetriever

PASSAGES = [(f"T{i}", f"passage {i} about paris") for i in range(6)]


class RecordingRetriever(KeywordRetriever):
    """Records every (queries, k) it is asked."""

    def __init__(self, passages=PASSAGES):
        super().__init__(passages)
        self.asked: list[tuple[list[str], int]] = []

    def batch_search(self, queries, k=10):
        self.asked.append((list(queries), k))
        return super().batch_search(queries, k)


# --- SearchQAEnv: constructor ------------------------------------------------------------------------------

def _env(**kwargs):
    kwargs.setdefault("retriever", RecordingRetriever())
    return SearchQAEnv(kwargs.pop("benchmark", "nq"), **kwargs)


class _RaisingRetriever(RecordingRetriever):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def batch_search(self, queries, k=10):
        raise self.error
