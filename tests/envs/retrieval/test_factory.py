"""``stppo_envs.retrieval.factory``: the backend a spec names, the refusals,
the cache folder and the demo corpus."""

from __future__ import annotations

import pytest

from stppo_envs.data import loading
from stppo_envs.retrieval import bm25, factory
from stppo_envs.retrieval.base import CachedRetriever

# ---------------------------------------------------------------- factory

class _Recorder:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def search(self, query, k=10):
        return []

    def batch_search(self, queries, k=10):
        return [[] for _ in queries]


def test_make_retriever_chooses_the_backend_from_the_spec(monkeypatch):
    from stppo_envs.retrieval import dense

    monkeypatch.setattr(bm25, "BM25Retriever", _Recorder)
    monkeypatch.setattr(dense, "DenseRetriever", _Recorder)
    cached = factory.make_retriever("  bm25:/idx/a ")
    assert isinstance(cached, CachedRetriever) and cached.maxsize == 65536
    assert cached.retriever.args == ("/idx/a",) and cached.retriever.kwargs == {}
    assert factory.make_retriever("bm25:/x:y", cache_size=5).maxsize == 5
    assert factory.make_retriever("bm25:/x:y", cache_size=0).args == ("/x:y",)
    prebuilt = factory.make_retriever("bm25-prebuilt:wikipedia-dpr-100w", cache_size=0)
    assert (prebuilt.args, prebuilt.kwargs) == (("wikipedia-dpr-100w",), {"prebuilt": True})
    dense_backend = factory.make_retriever("dense:/idx/d", cache_size=0)
    assert (dense_backend.args, dense_backend.kwargs) == (("/idx/d",), {})
    remote = factory.make_retriever("http://127.0.0.1:8000", cache_size=0)
    assert type(remote).__name__ == "RemoteRetriever" and remote.url == "http://127.0.0.1:8000/retrieve"
    assert factory.make_retriever("https://h/retrieve", cache_size=0).url == "https://h/retrieve"
    monkeypatch.setattr(factory, "demo_index_dir", lambda: "/demo/index")
    assert factory.make_retriever("demo", cache_size=0).args == ("/demo/index",)
    assert factory.demo_retriever().args == ("/demo/index",)


@pytest.mark.parametrize("spec, message", [
    ("bm25", "^bad retriever spec 'bm25'; retriever specs: 'demo'"),
    ("bm25:", "^bad retriever spec 'bm25:'"),
    ("faiss:/x", "^unknown retriever backend 'faiss' in 'faiss:/x'; retriever specs:"),
    ("Demo", "^bad retriever spec 'Demo'"),
])
def test_bad_retriever_specs_are_refused_with_the_spec_help(spec, message):
    with pytest.raises(ValueError, match=message):
        factory.make_retriever(spec)


def test_a_retriever_object_passes_through_and_anything_else_is_refused():
    backend = _Recorder()
    assert factory.make_retriever(backend) is backend and factory.make_retriever(backend, cache_size=0) is backend

    class SearchOnly:
        def search(self, query, k=10):
            return []

    with pytest.raises(TypeError, match=r"^a retriever needs search\(\) and batch_search\(\); got SearchOnly$"):
        factory.make_retriever(SearchOnly())


def test_cache_dir_and_demo_corpus(monkeypatch, tmp_path):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path))
    assert factory.cache_dir() == tmp_path
    monkeypatch.setenv("STPPO_CACHE_DIR", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert factory.cache_dir() == tmp_path / "home" / ".cache" / "stppo"
    monkeypatch.delenv("STPPO_CACHE_DIR")
    assert factory.cache_dir() == tmp_path / "home" / ".cache" / "stppo"
    assert factory.demo_corpus_path() == loading.DEMO_DIR / "corpus.jsonl" and factory.demo_corpus_path().is_file()
