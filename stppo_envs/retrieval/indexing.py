"""Corpus reading and index building shared by ``stppo index`` and the data scripts.

Corpora in the pyserini/FlashRAG layout (JSON lines ``{"id", "contents": "\\"Title\\"\\ntext"}``) are indexed
as they are; a few other common layouts are converted on the way in: JSON lines or a JSON list of
``{"id"?, "title", "text"}`` (MuSiQue), and a JSON object ``title -> [sentences]`` (HotpotQA distractor). Any of
them may be gzipped (``.gz``).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
import zlib
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
    """Yield (docid, contents) for every passage; pyserini ``contents`` pass through byte for byte.

    ``.gz`` files are read as they stream (``wiki-18.jsonl.gz``, ``corpus.json.gz``). Anything unreadable -- not
    UTF-8, not JSON, a truncated gzip file, a record that is not an object -- is a :class:`CorpusFormatError`
    naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    inner_suffix = Path(path.stem).suffix if path.suffix == ".gz" else path.suffix
    try:
        with _open_text(path) as handle:
            first_line = handle.readline()
            more = any(line.strip() for line in handle)  # stops at the first non-blank line after the first
        with _open_text(path) as handle:
            if inner_suffix == ".jsonl" or _is_passage_line(first_line, more):
                for number, line in enumerate(handle, start=1):
                    if line.strip():
                        yield _passage(json_record(line, number, path), number - 1, path)
                return
            try:
                data = json.load(handle)
            except json.JSONDecodeError as exc:
                raise CorpusFormatError(f"{path}: not JSON lines, and not JSON either ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise CorpusFormatError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError; a cut-off file, EOFError
        if path.suffix != ".gz":
            raise
        raise CorpusFormatError(f"{path}: not a readable gzip file ({str(exc) or type(exc).__name__})") from exc
    if isinstance(data, list):
        for number, record in enumerate(data):
            yield _passage(record, number, path)
    elif isinstance(data, dict):  # HotpotQA: title -> list of sentences
        for number, (title, sentences) in enumerate(data.items()):
            text = "".join(map(str, sentences)) if isinstance(sentences, list) else str(sentences)
            yield str(number), to_contents(title, text)
    else:
        raise CorpusFormatError(f"{path}: unsupported corpus layout (a JSON {type(data).__name__})")


def _open_text(path: Path):
    handle = gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")
    try:
        if handle.read(1) != "\ufeff":  # a byte-order mark (Windows editors, Excel) is not part of the first record
            handle.seek(0)
    except BaseException:
        handle.close()
        raise
    return handle


def json_record(line: str, number: int, path: Path) -> dict:
    """Line ``number`` of ``path`` as a JSON object, or a CorpusFormatError naming the file and the line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CorpusFormatError(f"{path}, line {number}: not JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise CorpusFormatError(f"{path}, line {number}: not a JSON object (a {type(record).__name__})")
    return record


def _is_passage_line(line: str, more: bool) -> bool:
    """A first line that is a whole JSON object, followed by more lines or itself a passage: JSON lines. A title ->
    sentences object written on one line (``json.dump``'s default) is the whole file and not a passage; a JSON-lines
    file whose records misname their text field stays JSON lines, so that the error names a passage's fields."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and (more or "contents" in record or "text" in record)


def _passage(record: dict, number: int, path: Path) -> tuple[str, str]:
    if not isinstance(record, dict):
        raise CorpusFormatError(f"{path}: passage {number} is not a JSON object (a {type(record).__name__})")
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
