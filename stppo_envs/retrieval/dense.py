"""Dense retrieval: faiss over passages embedded by a Hugging Face encoder.

Index folder layout (written by :func:`build_dense_index`, read by :class:`DenseRetriever`)::

    meta.json        encoder settings, faiss index type, dimension, passage count, corpus hash, and
                     ``passage_text: contents`` (passages embedded as stored, as Search-R1 embeds them;
                     indexes without it embedded the title unquoted)
    index.faiss      the faiss index (inner product over normalised vectors = cosine)
    docs/            the passages as a ``datasets`` arrow table (memory-mapped: a wiki-18 corpus does not
                     have to fit in RAM), row i = faiss id i

The build encodes in shards saved under ``shards/``; an interrupted build resumes from the last finished shard.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np

from .base import (
    BatchSearchMixin,
    Hit,
    IndexNotFoundError,
    ReopensAfterPickling,
    RetrievalError,
    hit_from_contents,
    parse_contents,
    passages_sha256,
    portable_name,
)
from .encoder import EncoderSettings, TextEncoder
from .indexing import iter_contents

BUILD_HINT = "build one with: stppo index dense --corpus CORPUS.jsonl --encoder MODEL --out {path}"
INDEX_TYPES = ("flat", "hnsw", "ivf")


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


def make_faiss_index(kind: str, dim: int, vectors: np.ndarray, *, hnsw_m: int = 32, ivf_lists: int | None = None):
    """A faiss inner-product index of ``kind`` (flat = exact IndexFlatIP; hnsw; ivf, trained on ``vectors``)."""
    import faiss

    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    elif kind == "ivf":
        lists = ivf_lists or max(1, min(4096, int(4 * np.sqrt(len(vectors)))))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
    else:
        raise ValueError(f"unknown faiss index type {kind!r}; known: {', '.join(INDEX_TYPES)}")
    index.add(vectors)
    return index


def _hit(row: dict, score: float) -> Hit:
    if row.get("contents") is not None:  # indexes built before contents were kept have title and text only
        return hit_from_contents(row["id"], score, row["contents"])
    return Hit(row["id"], score, row["title"], row["text"])


def build_dense_index(corpus: str | os.PathLike, out: str | os.PathLike, encoder: str, *, index_type: str = "flat",
                      shard_size: int = 4096, batch_size: int = 64, device: str | None = None,
                      progress: bool = True) -> Path:
    """Embed every passage of ``corpus`` with ``encoder`` and write a dense index folder at ``out``.

    Resumable: embeddings are saved shard by shard under ``out/shards``; rerunning the same command after an
    interruption skips the finished shards. The folder is usable only once ``meta.json`` is written (last).
    """
    import datasets
    import faiss
    from tqdm.auto import tqdm

    if index_type not in INDEX_TYPES:
        raise ValueError(f"unknown faiss index type {index_type!r}; known: {', '.join(INDEX_TYPES)}")
    out = Path(out)
    if (out / "meta.json").exists():
        raise FileExistsError(f"{out} already holds a dense index; remove it or choose another --out")
    settings = EncoderSettings.detect(encoder)
    shards_dir = out / "shards"
    shards_dir.mkdir(parents=True, exist_ok=True)
    _check_resume(out, settings, corpus)

    # One read of the corpus decides the vectors, the stored rows and the recorded hash alike.
    records = list(iter_contents(corpus))
    passages = [(docid, *parse_contents(contents), contents) for docid, contents in records]
    text_encoder = TextEncoder(settings, device, batch_size)
    shard_count = (len(passages) + shard_size - 1) // shard_size
    bar = tqdm(total=len(passages), desc="encoding passages", unit="passage", disable=not progress)
    for shard in range(shard_count):
        path = shards_dir / f"{shard:06d}.npy"
        chunk = passages[shard * shard_size:(shard + 1) * shard_size]
        if not path.exists():
            # `contents` as stored, quoted title line included: what Search-R1's index_builder.py embeds.
            vectors = text_encoder.encode_passages([contents for *_, contents in chunk])
            np.save(shards_dir / f"{shard:06d}.tmp.npy", vectors)
            os.replace(shards_dir / f"{shard:06d}.tmp.npy", path)  # a shard exists only when complete
        bar.update(len(chunk))
    bar.close()

    vectors = np.concatenate([np.load(shards_dir / f"{s:06d}.npy") for s in range(shard_count)])
    faiss.write_index(make_faiss_index(index_type, vectors.shape[1], vectors), str(out / "index.faiss"))
    # The stored contents (first line as the corpus has it) are kept for observations and `stppo serve`.
    docs = datasets.Dataset.from_dict({"id": [p[0] for p in passages], "title": [p[1] for p in passages],
                                       "text": [p[2] for p in passages], "contents": [p[3] for p in passages]})
    if (out / "docs").exists():
        shutil.rmtree(out / "docs")
    docs.save_to_disk(str(out / "docs"))
    meta = {"encoder": {**settings.__dict__}, "index_type": index_type, "dim": int(vectors.shape[1]),
            "count": len(passages), "corpus": str(corpus), "corpus_sha256": passages_sha256(records),
            "passage_text": "contents"}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(shards_dir)
    return out


def _check_resume(out: Path, settings: EncoderSettings, corpus) -> None:
    """Refuse to resume shards written with another encoder or corpus (they would mix embeddings)."""
    marker = out / "shards" / "build.json"
    current = {"encoder": settings.__dict__, "corpus": str(Path(corpus).resolve())}
    if marker.exists():
        previous = json.loads(marker.read_text())
        if previous != json.loads(json.dumps(current)):
            raise ValueError(f"{out} holds a partial build for {previous}; remove it to start over")
    else:
        marker.write_text(json.dumps(current))
