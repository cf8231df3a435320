"""Corpus reading and index building shared by ``stppo index`` and the data scripts.

Corpora in the pyserini/FlashRAG layout (JSON lines ``{"id", "contents": "\\"Title\\"\\ntext"}``) are indexed
as they are; a few other common layouts are converted on the way in: JSON lines or a JSON list of
``{"id"?, "title", "text"}`` (MuSiQue), and a JSON object ``title -> [sentences]`` (HotpotQA distractor).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .base import parse_contents, to_contents


class CorpusFormatError(ValueError):
    """A corpus file that is not in any supported layout."""


def iter_corpus(path: str | os.PathLike) -> Iterator[tuple[str, str, str]]:
    """Yield (docid, title, text) for every passage of a corpus file."""
    for docid, contents in iter_contents(path):
        title, text = parse_contents(contents)
        yield docid, title, text


def iter_contents(path: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """Yield (docid, contents) for every passage; pyserini ``contents`` pass through byte for byte."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    with open(path, encoding="utf-8") as handle:
        head = handle.read(1).lstrip()
        handle.seek(0)
        first_line = handle.readline()
        handle.seek(0)
        if path.suffix == ".jsonl" or _is_json_object(first_line):
            for number, line in enumerate(handle):
                if line.strip():
                    yield _passage(json.loads(line), number, path)
            return
        data = json.load(handle)
    if head == "[" or isinstance(data, list):
        for number, record in enumerate(data):
            yield _passage(record, number, path)
    elif isinstance(data, dict):  # HotpotQA: title -> list of sentences
        for number, (title, sentences) in enumerate(data.items()):
            text = "".join(sentences) if isinstance(sentences, list) else str(sentences)
            yield str(number), to_contents(title, text)
    else:
        raise CorpusFormatError(f"{path}: unsupported corpus layout")


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _passage(record: dict, number: int, path: Path) -> tuple[str, str]:
    docid = str(record.get("id", record.get("docid", number)))
    if "contents" in record:
        return docid, str(record["contents"])
    if "text" in record:
        return docid, to_contents(str(record.get("title", "")), str(record["text"]))
    raise CorpusFormatError(f"{path}: passage {number} has neither 'contents' nor 'text' (fields: {sorted(record)})")


def write_jsonl_collection(corpus: str | os.PathLike, folder: Path) -> int:
    """Write ``corpus`` as one pyserini JsonCollection file in ``folder``; returns the number of passages."""
    count, seen = 0, set()
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as out:
        for docid, contents in iter_contents(corpus):
            if docid in seen:
                raise CorpusFormatError(f"{corpus}: duplicate passage id {docid!r}")
            seen.add(docid)
            out.write(json.dumps({"id": docid, "contents": contents}, ensure_ascii=False) + "\n")
            count += 1
    if count == 0:
        raise CorpusFormatError(f"{corpus}: no passages")
    return count


def prepare_output_dir(out: str | os.PathLike) -> Path:
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def build_bm25_from_corpus(corpus: str | os.PathLike, out: str | os.PathLike, *, threads: int = 1,
                           quiet: bool = True) -> Path:
    """Build a pyserini BM25 index of ``corpus`` at ``out``, atomically (a half-built index never appears)."""
    from .bm25 import build_bm25_index

    out = prepare_output_dir(out)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as scratch:
        collection = Path(scratch) / "collection"
        collection.mkdir()
        count = write_jsonl_collection(corpus, collection)
        built = build_bm25_index(collection, Path(scratch) / "index", threads=threads, quiet=quiet)
        if out.exists():
            out.rmdir()
        shutil.move(str(built), out)
    print(f"indexed {count} passages")
    return out
