"""The retrieval server: a query the backend refuses is that query's failure, never the batch's (issue 30.6),
and a merged request hands every client exactly its own rows (issue 27.3)."""

from __future__ import annotations

import asyncio
import http.server
import itertools
import json
import string
import threading

import pytest
import requests

from stppo_envs.retrieval import Hit, RetrievalError, RetrieverUnavailableError, make_retriever
from stppo_envs.retrieval.base import PartialSearchError
from stppo_envs.retrieval.remote import RemoteRetriever
from stppo_envs.retrieval.server import ServerLimits, _Batcher

from .test_retrieval import threaded_server  # noqa: F401  (the fixture)

# 1,296 distinct two-character terms in 3,887 characters: under the env's 4,096-character query limit, over
# Lucene's 1,024-clause limit, so pyserini raises TooManyClauses for this query alone.
TOO_MANY_CLAUSES = " ".join("".join(p) for p in itertools.product(string.ascii_lowercase + string.digits, repeat=2))
GOOD = ["In which town was the founder born?", "first-line treatment fever", "river"]


@pytest.fixture(scope="module")
def demo_bm25():
    return make_retriever("demo", cache_size=0)


def test_a_query_lucene_refuses_fails_alone_through_stppo_serve(threaded_server, demo_bm25):  # noqa: F811
    from stppo_envs import make_vec

    assert len(TOO_MANY_CLAUSES) < 4096
    url, _ = threaded_server(demo_bm25)
    response = requests.post(f"{url}/retrieve", json={"queries": GOOD + [TOO_MANY_CLAUSES], "topk": 3,
                                                      "return_scores": True}, timeout=60)
    assert response.status_code == 200, response.text[:300]
    body = response.json()
    expected = demo_bm25.batch_search(GOOD, 3)
    assert [[item["document"]["id"] for item in row] for row in body["result"][:3]] == \
           [[hit.docid for hit in row] for row in expected]
    assert body["result"][3] == []
    assert [e["index"] for e in body["errors"]] == [3] and "maxClauseCount" in body["errors"][0]["message"]

    envs = make_vec("stppo/NQ-v0", 4, retriever=url)
    envs.reset(seed=0)
    _, _, _, _, infos = envs.step([f"<search>{q}</search>" for q in GOOD + [TOO_MANY_CLAUSES]])
    assert infos["search_calls"].tolist() == [1, 1, 1, 0]  # served [0, 1, 2]
    assert infos["search_errors"].tolist() == [0, 0, 0, 1]
    assert infos["_error"].tolist() == [False, False, False, True]
    assert infos["error"]["type"][3] == "RetrievalError" and "maxClauseCount" in infos["error"]["message"][3]

    remote = RemoteRetriever(url)
    with pytest.raises(PartialSearchError) as caught:
        remote.batch_search(GOOD + [TOO_MANY_CLAUSES] + GOOD[:1], 3)
    assert sorted(caught.value.errors) == [3] and caught.value.results[3] is None
    assert caught.value.results[:3] == expected and caught.value.results[4] == expected[0]
    with pytest.raises(RetrievalError, match="maxClauseCount") as alone:
        remote.search(TOO_MANY_CLAUSES, 3)
    assert type(alone.value) is RetrievalError  # its own error; not "server down": no retries, no 503
    chunked = RemoteRetriever(url, max_batch=2)  # a refused query in one request, the rest served in others
    with pytest.raises(PartialSearchError) as caught:
        chunked.batch_search(GOOD + [TOO_MANY_CLAUSES, GOOD[0]], 3)
    assert sorted(caught.value.errors) == [3] and caught.value.results[:3] == expected


class _Backend:
    """Rows that name their query and k; raises ``error`` for any batch holding a query that contains BAD."""

    def __init__(self, error=None):
        self.calls: list[tuple[list[str], int]] = []
        self.error = error

    def batch_search(self, queries, k=10):
        self.calls.append((list(queries), k))
        if self.error is not None and any("BAD" in q for q in queries):
            raise self.error
        return [[Hit(f"{q}#{j}", float(k - j), q, f"row {j} of {q!r}") for j in range(k)] for q in queries]

    def search(self, query, k=10):
        return self.batch_search([query], k)[0]


def _served(batcher: _Batcher, requests_: list[tuple[list[str], int]]):
    async def run():  # a request the batcher forgets fails the test instead of hanging it
        return await asyncio.wait_for(asyncio.gather(*(batcher.search(queries, k) for queries, k in requests_),
                                                     return_exceptions=True), timeout=10)

    return asyncio.run(run())


def _own_rows(queries, k):
    return [[f"{q}#{j}" for j in range(k)] for q in queries]


def test_merged_requests_hand_every_client_its_own_rows():
    backend = _Backend()
    batcher = _Batcher(backend, ServerLimits(batch_window_s=0.2))
    asked = [([f"a{i}" for i in range(3)], 2), (["b0"], 5), ([f"c{i}" for i in range(4)], 2), ([], 2),
             (["d0", "d1"], 1), (["e0"], 5), (["a0", "a0"], 2)]
    answers = _served(batcher, asked)
    for (queries, k), (rows, errors) in zip(asked, answers):
        assert errors == {}
        assert [[hit.docid for hit in row] for row in rows] == _own_rows(queries, k), (queries, k)
    # merged: one backend call per top-k, each holding its requests' queries in order
    assert sorted(backend.calls, key=lambda c: c[1]) == [
        (["d0", "d1"], 1), (["a0", "a1", "a2", "c0", "c1", "c2", "c3", "a0", "a0"], 2), (["b0", "e0"], 5)]
    assert batcher.queries_served == 3 + 1 + 4 + 2 + 1 + 2 and batcher.batches_served == 3


@pytest.mark.parametrize("error", [RetrievalError("backend refused a query"), RuntimeError("faiss: bad input")])
def test_a_merged_bad_query_fails_only_itself(error):
    backend = _Backend(error)
    batcher = _Batcher(backend, ServerLimits(batch_window_s=0.2))
    asked = [(["a0", "BAD a1", "a2"], 2), (["b0"], 2), (["c0", "c1"], 3), (["BAD d0"], 2), (["e0", "e1", "e2"], 2)]
    answers = _served(batcher, asked)
    for (queries, k), (rows, errors) in zip(asked, answers):
        bad = [i for i, q in enumerate(queries) if "BAD" in q]
        assert sorted(errors) == bad, queries
        for i, row in enumerate(rows):
            assert (row is None) if i in bad else [hit.docid for hit in row] == _own_rows([queries[i]], k)[0]
        for i in bad:
            assert isinstance(errors[i], RetrievalError) and str(error) in str(errors[i])
    assert batcher.queries_served == 10 - 2


def test_a_backend_that_is_down_fails_the_request_so_that_the_client_retries():
    batcher = _Batcher(_Backend(RetrieverUnavailableError("upstream server down")), ServerLimits())
    (answer,) = _served(batcher, [(["BAD x", "y"], 2)])
    assert isinstance(answer, RetrieverUnavailableError)


def test_a_backend_returning_the_wrong_number_of_rows_hands_out_no_rows():
    class Short(_Backend):
        def batch_search(self, queries, k=10):
            return super().batch_search(queries, k)[:-1]

    batcher = _Batcher(Short(), ServerLimits(batch_window_s=0.2))
    answers = _served(batcher, [(["a0", "a1"], 2), (["b0"], 2)])
    for rows, errors in answers:  # never a neighbour's row shifted into place
        assert all(row is None for row in rows) and all("rows for" in str(e) for e in errors.values())


class _FlakyHandler(http.server.BaseHTTPRequestHandler):
    statuses: list[int] = []
    hits = 0

    def do_POST(self):  # noqa: N802 (http.server's naming)
        type(self).hits += 1
        self.rfile.read(int(self.headers["content-length"]))
        status = self.statuses.pop(0) if self.statuses else 200
        body = json.dumps({"result": [[{"document": {"id": "7", "contents": '"T"\ntext'}, "score": 1.0}]]}
                          if status == 200 else {"detail": "overloaded"}).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_client_still_retries_a_server_that_is_really_down():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FlakyHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        _FlakyHandler.statuses, _FlakyHandler.hits = [503, 503], 0
        assert RemoteRetriever(url, retries=2, backoff=0).search("q", 1)[0].docid == "7"
        assert _FlakyHandler.hits == 3
        _FlakyHandler.statuses, _FlakyHandler.hits = [503] * 5, 0
        with pytest.raises(RetrieverUnavailableError):
            RemoteRetriever(url, retries=2, backoff=0).search("q", 1)
        assert _FlakyHandler.hits == 3
    finally:
        server.shutdown()


def test_the_cache_reports_a_partial_failure_at_the_callers_positions():
    from stppo_envs.retrieval import CachedRetriever, search_each

    class Partial(_Backend):  # answers as a remote client does when the server refused some queries
        def batch_search(self, queries, k=10):
            rows = super().batch_search(queries, k)
            errors = {i: RetrievalError(f"refused {q}") for i, q in enumerate(queries) if "BAD" in q}
            if errors:
                raise PartialSearchError([None if i in errors else row for i, row in enumerate(rows)], errors)
            return rows

    backend = Partial()
    cached = CachedRetriever(backend)
    with pytest.raises(PartialSearchError) as caught:
        cached.batch_search(["a", "BAD1", "b", "BAD1", "a"], 1)
    assert backend.calls == [(["a", "BAD1", "b"], 1)]  # each distinct query once
    assert sorted(caught.value.errors) == [1, 3] and str(caught.value.errors[3]) == "refused BAD1"
    assert [row and row[0].docid for row in caught.value.results] == ["a#0", None, "b#0", None, "a#0"]
    with pytest.raises(PartialSearchError):
        cached.batch_search(["a", "BAD1"], 1)
    assert backend.calls[-1] == (["BAD1"], 1)  # a refused query is asked again; the served one came from the cache
    backend.calls.clear()
    assert search_each(cached, ["b", "a"], 1)[0] == [backend.search("b", 1), backend.search("a", 1)]
    assert backend.calls == [(["b"], 1), (["a"], 1)]  # the two served before came from the cache
    cached.batch_search(["z"])
    assert backend.calls[-1] == (["z"], 10)  # the default k is pyserini's 10
    rows, errors = search_each(_Backend(RetrieverUnavailableError("down")), [f"BAD {i}" for i in range(64)], 1)
    assert rows == [None] * 64 and len(errors) == 64


def test_search_each_finds_a_refused_query_in_few_calls():
    from stppo_envs.retrieval import search_each

    backend = _Backend(RetrievalError("refused"))
    queries = [f"q{i}" for i in range(1024)]
    queries[700] = "BAD"
    rows, errors = search_each(backend, queries, 1)
    assert list(errors) == [700] and rows[699][0].docid == "q699#0" and rows[701][0].docid == "q701#0"
    assert len(backend.calls) <= 2 * 10 + 1  # halving: about two calls per level of a 1,024-query batch
