"""HTTP client for a retrieval server speaking Search-R1's API (ours, ``stppo serve``, or Search-R1's own).

``POST /retrieve {"queries": [...], "topk": k, "return_scores": true}`` ->
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}``. Connection failures, timeouts and
502/503/504 answers are retried with backoff (urllib3 ``Retry``), then raised as
:class:`RetrieverUnavailableError`. Queries the server answered with a per-query error (``"errors"``, see
``server.py``) raise :class:`PartialSearchError`, which carries the rows of the queries that were served (a
single search raises its own :class:`RetrievalError`).
"""

from __future__ import annotations

from typing import Sequence

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from .base import (
    BatchSearchMixin,
    Hit,
    PartialSearchError,
    ReopensAfterPickling,
    RetrievalError,
    RetrieverUnavailableError,
    hit_from_contents,
)


class RemoteRetriever(ReopensAfterPickling, BatchSearchMixin):
    """Search through a retrieval server at ``url`` (``http://host:port``; ``/retrieve`` is appended)."""

    _transient = ("_session", "_index_id")

    def __init__(self, url: str, *, timeout: float = 30.0, retries: int = 2, backoff: float = 0.2,
                 max_batch: int = 512):
        self.url = url.rstrip("/")
        if not self.url.endswith("/retrieve"):
            self.url += "/retrieve"
        self.timeout, self.retries, self.backoff, self.max_batch = timeout, retries, backoff, max_batch
        self._session: requests.Session | None = None

    @property
    def index_id(self) -> str:
        """The served index's own id (a `stppo serve` says it in /health); a server that does not say (Search-R1's)
        is known by its URL only."""
        if getattr(self, "_index_id", None) is None:
            try:
                health = self.session.get(self.url.rsplit("/retrieve", 1)[0] + "/health", timeout=self.timeout).json()
                self._index_id = f"remote:{health['index_id']}" if health.get("index_id") else f"remote:{self.url}"
            except (requests.RequestException, ValueError, KeyError, TypeError, AttributeError):
                self._index_id = f"remote:{self.url}"
        return self._index_id

    @property
    def session(self) -> requests.Session:
        if self._session is None:
            retry = Retry(total=self.retries, connect=self.retries, read=self.retries, backoff_factor=self.backoff,
                          status_forcelist=(502, 503, 504), allowed_methods=frozenset({"POST"}))
            session = requests.Session()
            adapter = HTTPAdapter(max_retries=retry, pool_maxsize=64)  # many rollout threads may share one client
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            self._session = session
        return self._session

    def batch_search(self, queries: Sequence[str], k: int = 10) -> list[list[Hit]]:
        results: list[list[Hit] | None] = []
        errors: dict[int, RetrievalError] = {}
        for start in range(0, len(queries), self.max_batch):  # servers cap request sizes
            rows, failed = self._post(list(queries[start:start + self.max_batch]), k)
            results += rows
            errors.update({start + i: e for i, e in failed.items()})
        if len(queries) == 1 and errors:  # a single search fails with its own error
            raise errors[0]
        if errors:
            raise PartialSearchError(results, errors)
        return results  # type: ignore[return-value]

    def _post(self, queries: list[str], k: int) -> tuple[list[list[Hit] | None], dict[int, RetrievalError]]:
        """One request: its rows (None where the server refused the query) and the per-query errors."""
        if not queries:
            return [], {}
        payload = {"queries": queries, "topk": k, "return_scores": True}
        try:
            response = self.session.post(self.url, json=payload, timeout=self.timeout)
        except requests.RequestException as exc:
            raise RetrieverUnavailableError(f"retrieval server {self.url} unreachable: {exc}") from exc
        if response.status_code >= 500:
            raise RetrieverUnavailableError(f"retrieval server {self.url} failed ({response.status_code}): "
                                            f"{response.text[:300]}")
        if response.status_code >= 400:
            raise RetrievalError(f"retrieval server {self.url} rejected the request ({response.status_code}): "
                                 f"{response.text[:300]}")
        try:
            answer = response.json()
            rows = [[_hit(item) for item in row] for row in answer["result"]]
            errors = {int(e["index"]): RetrievalError(f"retrieval server {self.url}: {e['message']}")
                      for e in answer.get("errors") or []}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RetrievalError(f"retrieval server {self.url} sent an unexpected answer: {exc}") from exc
        if len(rows) != len(queries) or not all(0 <= i < len(rows) for i in errors):  # rows match by position only
            raise RetrievalError(f"retrieval server {self.url} sent {len(rows)} rows (errors at {sorted(errors)}) "
                                 f"for {len(queries)} queries")
        return [None if i in errors else row for i, row in enumerate(rows)], errors

    def __repr__(self) -> str:
        return f"RemoteRetriever({self.url!r})"


def _hit(item: dict) -> Hit:
    """One Search-R1 result (``{"document": {...}, "score": s}``, or a bare document without scores)."""
    document = item.get("document", item)
    docid, score = str(document.get("id", document.get("docid", ""))), float(item.get("score", 0.0))
    if "contents" in document:
        return hit_from_contents(docid, score, document["contents"])
    return Hit(docid, score, document.get("title", ""), document.get("text", ""))
