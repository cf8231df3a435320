"""``stppo_envs.retrieval.bm25``: BM25 over a Lucene index, with pyserini's
searcher and indexer faked."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from stppo_envs.retrieval import IndexNotFoundError, bm25
from stppo_envs.retrieval.base import Hit, passages_sha256
from tests.support.retrieval_backends import _FakeSearcher, _lucene_dir


def test_bm25_settings_and_the_index_check(tmp_path):
    retriever = bm25.BM25Retriever(_lucene_dir(tmp_path / "idx"))
    assert (retriever.index, retriever.prebuilt, retriever.k1, retriever.b, retriever.threads) == \
        (str(tmp_path / "idx"), False, 0.9, 0.4, 1)
    assert retriever._searcher is None and repr(retriever) == f"BM25Retriever({str(tmp_path / 'idx')!r})"
    custom = bm25.BM25Retriever("wikipedia-dpr-100w", prebuilt=True, k1=1.2, b=0.75, threads=4)
    assert (custom.prebuilt, custom.k1, custom.b, custom.threads) == (True, 1.2, 0.75, 4)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for where in ("empty", "file", "missing"):
        with pytest.raises(IndexNotFoundError, match=rf"^no Lucene index at {tmp_path / where}; build one with: "
                                                      rf"stppo index bm25 --corpus CORPUS.jsonl --out "
                                                      rf"{tmp_path / where}$"):
            bm25.BM25Retriever(tmp_path / where)


def test_bm25_single_and_batched_searches_map_hits_in_query_order(tmp_path):
    retriever = bm25.BM25Retriever(_lucene_dir(tmp_path / "idx"), threads=3)
    retriever._searcher = searcher = _FakeSearcher()
    assert retriever.batch_search([], 5) == [] and searcher.calls == []
    hits = retriever.search("q", k=2)
    assert hits == [Hit("q-0", 10.0, "T0", "q 0"), Hit("q-1", 9.0, "T1", "q 1")]
    assert type(hits[0].score) is float and hits[0].title_line == '"T0"'
    assert searcher.calls == [("search", "q", 2)]
    retriever.batch_search(["d"])
    assert searcher.calls[-1] == ("search", "d", 10)  # the default k
    batched = retriever.batch_search(("a", "b"), 1)
    assert [[h.docid for h in row] for row in batched] == [["a-0"], ["b-0"]]
    assert searcher.calls[-1] == ("batch_search", ["a", "b"], ["0", "1"], 1, 3)


def test_build_bm25_index_runs_pyserinis_indexer_with_its_recipe_flags(tmp_path, monkeypatch):
    runs = []

    class IndexCollection:
        @staticmethod
        def main(args):
            runs.append(list(args))
            _lucene_dir(Path(args[args.index("-index") + 1]))

    monkeypatch.setattr(bm25, "ensure_pyserini", lambda: runs.append("jvm"))
    monkeypatch.setitem(sys.modules, "jnius", types.SimpleNamespace(
        autoclass=lambda name: IndexCollection if name == "io.anserini.index.IndexCollection" else None))
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.jsonl").write_text('{"id": 2, "contents": "two"}\n\n')
    (corpus / "sub" / "a.jsonl").write_text('{"id": "1", "contents": "one"}\n')
    monkeypatch.chdir(tmp_path)
    out = bm25.build_bm25_index("corpus", "index", threads=2)
    assert out == Path("index")
    assert runs == ["jvm", ["-collection", "JsonCollection", "-generator", "DefaultLuceneDocumentGenerator",
                            "-input", str(tmp_path / "corpus"), "-index", str(tmp_path / "index"), "-threads", "2",
                            "-storePositions", "-storeDocvectors", "-storeRaw", "-quiet"]]
    meta = json.loads((tmp_path / "index" / "stppo_index.json").read_text())
    assert meta == {"kind": "bm25", "corpus_sha256": passages_sha256([("2", "two"), ("1", "one")])}
    bm25.build_bm25_index(corpus, tmp_path / "loud", quiet=False)
    assert runs[-1][-1] == "-storeRaw" and runs[-1][runs[-1].index("-threads") + 1] == "1"
    with pytest.raises(FileNotFoundError, match="^corpus folder not found: .*nothing$"):
        bm25.build_bm25_index(tmp_path / "nothing", tmp_path / "x")

    IndexCollection.main = staticmethod(lambda args: None)  # the indexer wrote nothing
    with pytest.raises(IndexNotFoundError, match="no Lucene index at"):
        bm25.build_bm25_index(corpus, tmp_path / "y")
