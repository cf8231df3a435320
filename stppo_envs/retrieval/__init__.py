"""Search backends behind one protocol: BM25 (pyserini), dense (faiss), remote (HTTP)."""

from .base import (
    CachedRetriever,
    Hit,
    IndexNotFoundError,
    PartialSearchError,
    RetrievalError,
    Retriever,
    RetrieverUnavailableError,
    parse_contents,
    search_each,
    to_contents,
)
from .factory import demo_retriever, make_retriever

__all__ = [
    "CachedRetriever", "Hit", "IndexNotFoundError", "PartialSearchError", "RetrievalError", "Retriever",
    "RetrieverUnavailableError",
    "demo_retriever", "make_retriever", "parse_contents", "search_each", "to_contents",
]
