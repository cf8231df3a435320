"""Dense retrieval: faiss over passages embedded by a Hugging Face encoder.

Index folder layout (written by :func:`build_dense_index`, read by :class:`DenseRetriever`)::

    meta.json        encoder settings, faiss index type, dimension, passage count, corpus hash, and
                     ``passage_text: contents`` (passages embedded as stored, as Search-R1 embeds them;
                     indexes without it embedded the title unquoted)
    index.faiss      the faiss index (inner product over normalised vectors = cosine)
    docs/            the passages as a ``datasets`` arrow table (memory-mapped: a wiki-18 corpus does not
                     have to fit in RAM), row i = faiss id i

Building (:func:`build_dense_index`, resumable shard by shard) lives in :mod:`.dense_build`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from .base import (
    BatchSearchMixin,
    Hit,
    IndexNotFoundError,
    ReopensAfterPickling,
    RetrievalError,
    hit_from_contents,
    portable_name,
)
from .dense_build import INDEX_TYPES, build_dense_index, make_faiss_index  # noqa: F401 (the build's public names)
from .encoder import EncoderSettings, TextEncoder

BUILD_HINT = "build one with: stppo index dense --corpus CORPUS.jsonl --encoder MODEL --out {path}"


class DenseRetriever(ReopensAfterPickling, BatchSearchMixin):
    """faiss search over a dense index folder; queries are encoded with the index's own encoder settings.

    ``encoder`` overrides the stored encoder path (for an index built elsewhere); ``nprobe`` / ``ef_search``
    tune IVF / HNSW recall. Pickles by its arguments.
    """

    _transient = ("_loaded",)

    def __init__(self, index_dir: str | os.PathLike, *, encoder: str | None = None, device: str | None = None,
                 nprobe: int = 32, ef_search: int = 128):
        self.index_dir = Path(index_dir)
        check_dense_index(self.index_dir)
        self.meta = json.loads((self.index_dir / "meta.json").read_text())
        settings = dict(self.meta["encoder"])
        if encoder is not None:
            settings["model"] = encoder
        self.settings = EncoderSettings(**settings)
        self.device, self.nprobe, self.ef_search = device, nprobe, ef_search
        self._loaded = None

    @property
    def index_id(self) -> str:
        """Corpus content hash (recorded at build time), faiss index type and encoder; never a local path."""
        corpus = self.meta.get("corpus_sha256")
        corpus = f"corpus-sha256:{corpus[:16]}" if corpus else f"{self.meta['count']}-passages"
        index_id = f"dense:{self.meta['index_type']}:{corpus}:encoder:{portable_name(self.settings.model)}"
        # Built before passages were embedded as stored: other vectors for the same corpus and encoder.
        return index_id if self.meta.get("passage_text") == "contents" else index_id + ":unquoted-titles"

    def _load(self):
        if self._loaded is None:
            import datasets
            import faiss

            index = faiss.read_index(str(self.index_dir / "index.faiss"))
            if hasattr(index, "nprobe"):
                index.nprobe = self.nprobe
            if hasattr(index, "hnsw"):
                index.hnsw.efSearch = self.ef_search
            docs = datasets.load_from_disk(str(self.index_dir / "docs"))
            self._loaded = (index, docs, TextEncoder(self.settings, self.device))
        return self._loaded

    def batch_search(self, queries: Sequence[str], k: int = 10) -> list[list[Hit]]:
        if not queries:
            return []
        index, docs, encoder = self._load()
        try:
            scores, ids = index.search(encoder.encode_queries(list(queries)), k)
        except Exception as exc:
            raise RetrievalError(f"dense search failed on {self.index_dir}: {exc}") from exc
        wanted = sorted({int(i) for row in ids for i in row if i >= 0})
        rows = dict(zip(wanted, docs.select(wanted))) if wanted else {}
        return [[_hit(rows[int(i)], float(s)) for s, i in zip(score_row, id_row) if i >= 0]
                for score_row, id_row in zip(scores, ids)]

    def __repr__(self) -> str:
        return f"DenseRetriever({str(self.index_dir)!r})"


def check_dense_index(path: Path) -> None:
    missing = [name for name in ("meta.json", "index.faiss", "docs") if not (Path(path) / name).exists()]
    if missing:
        raise IndexNotFoundError(f"no complete dense index at {path} (missing {', '.join(missing)}); "
                                 + BUILD_HINT.format(path=path))


def _hit(row: dict, score: float) -> Hit:
    if row.get("contents") is not None:  # indexes built before contents were kept have title and text only
        return hit_from_contents(row["id"], score, row["contents"])
    return Hit(row["id"], score, row["title"], row["text"])
