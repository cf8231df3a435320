"""Building a dense index folder (read by :class:`~stppo_envs.retrieval.dense.DenseRetriever`).

Passages are embedded shard by shard into ``OUT/shards/``; rerunning the same command after an interruption
skips the finished shards. A resume is only safe when everything that decides the vectors is what the shards
were written with, so ``shards/build.json`` records it -- the encoder and its settings (pooling, normalisation,
max length, prefixes), the passage text convention, the shard size and the corpus's content hash -- and a resume
that would change any of them is refused, naming the difference. Shard lengths and the total vector count are
checked against the corpus before the index is written: a vector never lands on another passage's row.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from .base import parse_contents, passages_sha256
from .encoder import EncoderSettings, TextEncoder
from .indexing import CorpusFormatError, iter_contents

INDEX_TYPES = ("flat", "hnsw", "ivf")
BUILD_RECORD = "build.json"


def make_faiss_index(kind: str, dim: int, vectors: np.ndarray, *, hnsw_m: int = 32, ivf_lists: int | None = None):
    """A faiss inner-product index of ``kind`` (flat = exact IndexFlatIP; hnsw; ivf, trained on ``vectors``)."""
    import faiss

    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    elif kind == "ivf":
        wanted = ivf_lists or max(1, min(4096, int(4 * np.sqrt(len(vectors)))))
        lists = max(1, min(wanted, len(vectors)))  # k-means cannot train more centroids than it has points
        if lists < wanted:
            print(f"ivf: {len(vectors)} passages allow at most {len(vectors)} lists; using {lists} instead of "
                  f"{wanted}", file=sys.stderr)
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
    else:
        raise ValueError(f"unknown faiss index type {kind!r}; known: {', '.join(INDEX_TYPES)}")
    index.add(vectors)
    return index


def build_dense_index(corpus: str | os.PathLike, out: str | os.PathLike, encoder: str, *, index_type: str = "flat",
                      shard_size: int = 4096, batch_size: int = 64, device: str | None = None,
                      progress: bool = True) -> Path:
    """Embed every passage of ``corpus`` with ``encoder`` and write a dense index folder at ``out``.

    Resumable (see the module's docstring). The folder is usable only once ``meta.json`` is written (last).
    """
    import datasets
    import faiss
    from tqdm.auto import tqdm

    # Everything that can be refused is checked before OUT is created: a refused build leaves nothing behind.
    if index_type not in INDEX_TYPES:
        raise ValueError(f"unknown faiss index type {index_type!r}; known: {', '.join(INDEX_TYPES)}")
    for name, value in (("shard_size", shard_size), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    out = Path(out)
    if (out / "meta.json").exists():
        raise FileExistsError(f"{out} already holds a dense index; remove it or choose another --out")
    # One read of the corpus decides the vectors, the stored rows and the recorded hash alike.
    records = list(iter_contents(corpus))
    if not records:
        raise CorpusFormatError(f"{corpus}: no passages")
    passages = [(docid, *parse_contents(contents), contents) for docid, contents in records]
    settings = EncoderSettings.detect(encoder)
    text_encoder = TextEncoder(settings, device, batch_size)
    record = {"encoder": dataclasses.asdict(settings), "passage_text": "contents", "shard_size": shard_size,
              "passages": len(records), "corpus_sha256": passages_sha256(records)}
    shards_dir = out / "shards"
    shards_dir.mkdir(parents=True, exist_ok=True)
    _check_resume(shards_dir, record)

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

    vectors = _load_shards(shards_dir, shard_count, shard_size, len(passages))
    faiss.write_index(make_faiss_index(index_type, vectors.shape[1], vectors), str(out / "index.faiss"))
    # The stored contents (first line as the corpus has it) are kept for observations and `stppo serve`.
    docs = datasets.Dataset.from_dict({"id": [p[0] for p in passages], "title": [p[1] for p in passages],
                                       "text": [p[2] for p in passages], "contents": [p[3] for p in passages]})
    if (out / "docs").exists():
        shutil.rmtree(out / "docs")
    docs.save_to_disk(str(out / "docs"))
    meta = {"encoder": record["encoder"], "index_type": index_type, "dim": int(vectors.shape[1]),
            "count": len(passages), "corpus": str(corpus), "corpus_sha256": record["corpus_sha256"],
            "passage_text": "contents"}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(shards_dir)
    return out


def _check_resume(shards_dir: Path, record: dict) -> None:
    """Refuse to resume shards written under another record: mixed shards give passages other passages' vectors."""
    marker = shards_dir / BUILD_RECORD
    if marker.exists():
        changed = _differences(json.loads(marker.read_text()), json.loads(json.dumps(record)))
        if changed:
            raise ValueError(f"{shards_dir} holds a partial build whose vectors these settings would not reproduce "
                             f"({'; '.join(changed)}); rerun with the settings it was written with to resume, or "
                             f"remove {shards_dir} to start over")
    elif any(shards_dir.glob("*.npy")):
        raise ValueError(f"{shards_dir} holds shards without a record of how they were written (an older stppo); "
                         f"remove it to start over")
    else:
        marker.with_suffix(".tmp").write_text(json.dumps(record, indent=2) + "\n")
        os.replace(marker.with_suffix(".tmp"), marker)


def _differences(before: dict, now: dict, prefix: str = "") -> list[str]:
    """``key: old when the shards were written, new now`` for every field that differs (nested keys dotted)."""
    changed = []
    for key in sorted(set(before) | set(now)):
        old, new = before.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changed += _differences(old, new, f"{prefix}{key}.")
        elif old != new:
            note = " -- the corpus changed" if key == "corpus_sha256" else ""
            changed.append(f"{prefix}{key}: {old} when the shards were written, {new} now{note}")
    return changed


def _load_shards(shards_dir: Path, shard_count: int, shard_size: int, passages: int) -> np.ndarray:
    chunks = []
    for shard in range(shard_count):
        vectors = np.load(shards_dir / f"{shard:06d}.npy")
        expected = min(shard_size, passages - shard * shard_size)
        if vectors.ndim != 2 or len(vectors) != expected:
            raise ValueError(f"{shards_dir}: shard {shard} holds {len(vectors)} vectors for {expected} passages; "
                             f"remove {shards_dir} to start over")
        chunks.append(vectors)
    vectors = np.concatenate(chunks)
    if len(vectors) != passages:  # the index's row i must be passage i
        raise ValueError(f"{shards_dir}: {len(vectors)} vectors for {passages} passages; remove it to start over")
    return vectors
