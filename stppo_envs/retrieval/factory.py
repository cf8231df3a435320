"""Build a retriever from a spec string, and the bundled demo index."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from .base import CachedRetriever, Retriever

SPEC_HELP = (
    "retriever specs: 'demo' (BM25 over the bundled demo corpus), 'bm25:INDEX_DIR', "
    "'bm25-prebuilt:NAME' (a pyserini prebuilt index), 'dense:INDEX_DIR', 'http://HOST:PORT' (a stppo or "
    "Search-R1 retrieval server)"
)


def make_retriever(spec: str | Retriever, *, cache_size: int = 65536) -> Retriever:
    """A retriever from a spec string (see :data:`SPEC_HELP`); a retriever object is returned unchanged.

    String specs get an LRU cache keyed by (query, k) unless ``cache_size`` is 0.
    """
    if not isinstance(spec, str):
        if not (hasattr(spec, "search") and hasattr(spec, "batch_search")):
            raise TypeError(f"a retriever needs search() and batch_search(); got {type(spec).__name__}")
        return spec
    backend = _backend_from_spec(spec.strip())
    return CachedRetriever(backend, cache_size) if cache_size else backend


def _backend_from_spec(spec: str) -> Retriever:
    scheme, sep, rest = spec.partition(":")
    if spec == "demo":
        return demo_retriever()
    if scheme in ("http", "https"):
        from .remote import RemoteRetriever

        return RemoteRetriever(spec)
    if not sep or not rest:
        raise ValueError(f"bad retriever spec {spec!r}; {SPEC_HELP}")
    if scheme == "bm25":
        from .bm25 import BM25Retriever

        return BM25Retriever(rest)
    if scheme == "bm25-prebuilt":
        from .bm25 import BM25Retriever

        return BM25Retriever(rest, prebuilt=True)
    if scheme == "dense":
        from .dense import DenseRetriever

        return DenseRetriever(rest)
    raise ValueError(f"unknown retriever backend {scheme!r} in {spec!r}; {SPEC_HELP}")


def cache_dir() -> Path:
    """Where derived artefacts (the demo index, converted models) live: ``$STPPO_CACHE_DIR`` or ~/.cache/stppo."""
    return Path(os.environ.get("STPPO_CACHE_DIR") or Path.home() / ".cache" / "stppo")


def demo_corpus_path() -> Path:
    from ..data.loading import DEMO_DIR

    return DEMO_DIR / "corpus.jsonl"


@functools.lru_cache(maxsize=None)
def demo_index_dir() -> Path:
    """The BM25 index of the demo corpus, built once per corpus version into the cache (about 10 s)."""
    from .bm25 import build_bm25_index

    corpus = demo_corpus_path()
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()[:12]
    target = cache_dir() / "indexes" / f"demo-bm25-{digest}"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            collection = Path(scratch) / "collection"
            collection.mkdir()
            shutil.copy(corpus, collection / "corpus.jsonl")
            built = build_bm25_index(collection, Path(scratch) / "index")
            try:
                os.replace(built, target)  # atomic: a concurrent builder's finished index wins
            except OSError:
                if not target.exists():
                    raise
    return target


def demo_retriever() -> Retriever:
    from .bm25 import BM25Retriever

    return BM25Retriever(demo_index_dir())
