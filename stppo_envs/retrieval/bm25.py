"""BM25 over a Lucene index with pyserini's ``LuceneSearcher``.

Index directories are exactly what pyserini's own indexer writes (``python -m pyserini.index.lucene
--collection JsonCollection --storeRaw``); :func:`build_bm25_index` runs that same indexer in-process, so
any pyserini index (including ``from_prebuilt_index`` names such as ``wikipedia-dpr-100w``) works here.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

from ._pyserini import ensure_pyserini
from .base import (
    BatchSearchMixin,
    Hit,
    IndexNotFoundError,
    ReopensAfterPickling,
    RetrievalError,
    hit_from_contents,
    passages_sha256,
)

BUILD_HINT = "build one with: stppo index bm25 --corpus CORPUS.jsonl --out {path}"
INDEX_META = "stppo_index.json"  # written beside Lucene's files: the corpus's content hash


class BM25Retriever(ReopensAfterPickling, BatchSearchMixin):
    """pyserini ``LuceneSearcher`` behind the retriever protocol.

    ``index`` is a directory or, with ``prebuilt=True``, a pyserini prebuilt-index name (downloaded by
    pyserini on a connected machine). ``k1``/``b`` default to pyserini's 0.9/0.4. Pickles by its arguments:
    the Java searcher is reopened lazily in the receiving process.
    """

    _transient = ("_searcher",)

    def __init__(self, index: str | os.PathLike, *, prebuilt: bool = False, k1: float = 0.9, b: float = 0.4,
                 threads: int = 1):
        self.index = str(index)
        self.prebuilt = prebuilt
        self.k1, self.b, self.threads = k1, b, threads
        if not prebuilt:
            check_bm25_index(self.index)
        self._searcher = None

    @property
    def index_id(self) -> str:
        """The index by content: the corpus hash recorded at build time; for an index built elsewhere, the hash
        of its Lucene commit (unique per build); the name of a prebuilt index. Never a local path."""
        if self.prebuilt:
            return f"bm25-prebuilt:{self.index}"
        meta = Path(self.index) / INDEX_META
        if meta.exists():
            return f"bm25:corpus-sha256:{json.loads(meta.read_text())['corpus_sha256'][:16]}"
        commit = max(Path(self.index).glob("segments_*"), key=lambda p: p.name)
        return f"bm25:lucene-commit-sha256:{hashlib.sha256(commit.read_bytes()).hexdigest()[:16]}"

    @property
    def searcher(self):
        if self._searcher is None:
            ensure_pyserini()
            from pyserini.search.lucene import LuceneSearcher

            if self.prebuilt:
                searcher = LuceneSearcher.from_prebuilt_index(self.index)
                if searcher is None:
                    raise IndexNotFoundError(f"pyserini has no prebuilt index named {self.index!r}")
            else:  # absolute: Java resolves a relative path against its own start directory, not Python's cwd
                searcher = LuceneSearcher(str(Path(self.index).absolute()))
            searcher.set_bm25(self.k1, self.b)
            self._searcher = searcher
        return self._searcher

    def batch_search(self, queries: Sequence[str], k: int = 10) -> list[list[Hit]]:
        if not queries:
            return []
        searcher = self.searcher
        try:
            if len(queries) == 1:
                raw = [searcher.search(queries[0], k=k)]
            else:
                qids = [str(i) for i in range(len(queries))]
                by_qid = searcher.batch_search(list(queries), qids, k=k, threads=self.threads)
                raw = [by_qid[qid] for qid in qids]
        except Exception as exc:  # a Java exception surfaces as jnius.JavaException, its stack trace appended
            reason = next(iter(str(exc).splitlines()), type(exc).__name__)
            raise RetrievalError(f"BM25 search failed on {self.index}: {reason}") from exc
        return [[self._to_hit(searcher, r) for r in results] for results in raw]

    @staticmethod
    def _to_hit(searcher, result) -> Hit:
        raw = result.lucene_document.get("raw") if result.lucene_document is not None else None
        if raw is None:
            doc = searcher.doc(result.docid)
            raw = doc.raw() if doc is not None else None
        if raw is None:
            raise RetrievalError(f"index stores no raw text for {result.docid}: rebuild it with --storeRaw")
        fields = json.loads(raw)
        return hit_from_contents(str(result.docid), float(result.score), fields.get("contents", ""))

    def __repr__(self) -> str:
        return f"BM25Retriever({self.index!r})"


def check_bm25_index(path: str | os.PathLike) -> None:
    """Raise :class:`IndexNotFoundError` naming the build command unless ``path`` is a Lucene index."""
    directory = Path(path)
    if not directory.is_dir() or not any(directory.glob("segments_*")):
        raise IndexNotFoundError(f"no Lucene index at {directory}; " + BUILD_HINT.format(path=directory))


def build_bm25_index(corpus_dir: str | os.PathLike, out_dir: str | os.PathLike, *, threads: int = 1,
                     quiet: bool = True) -> Path:
    """Index a folder of pyserini JsonCollection files (``{"id", "contents"}`` per line) into ``out_dir``.

    Runs pyserini's own ``IndexCollection`` (the class behind ``python -m pyserini.index.lucene``) with the
    flags of its BM25 recipes, so the index is byte-for-byte what pyserini would build. With ``quiet=False``
    Anserini logs its progress (documents indexed so far) while it runs: worth it for a 21M-passage corpus.
    """
    ensure_pyserini()
    from jnius import autoclass

    corpus_dir, out_dir = Path(corpus_dir), Path(out_dir)
    if not corpus_dir.is_dir():
        raise FileNotFoundError(f"corpus folder not found: {corpus_dir}")
    args = [
        "-collection", "JsonCollection",
        "-generator", "DefaultLuceneDocumentGenerator",
        # absolute: the JVM resolves relative paths against the directory it started in, which an os.chdir after
        # the first pyserini call (a notebook, a test, a library user) no longer matches
        "-input", str(corpus_dir.absolute()),
        "-index", str(out_dir.absolute()),
        "-threads", str(threads),
        "-storePositions", "-storeDocvectors", "-storeRaw",
    ] + (["-quiet"] if quiet else [])
    autoclass("io.anserini.index.IndexCollection").main(args)
    check_bm25_index(out_dir)
    files = sorted(p for p in corpus_dir.rglob("*") if p.is_file())
    passages = ((str(r["id"]), r["contents"]) for f in files for line in open(f, encoding="utf-8")
                if line.strip() for r in [json.loads(line)])
    # Lucene ignores files its commit does not name, so the index stays a plain pyserini index.
    (out_dir / INDEX_META).write_text(json.dumps({"kind": "bm25", "corpus_sha256": passages_sha256(passages)}) + "\n")
    return out_dir
