"""``stppo_envs.retrieval.server``: the limits at their boundaries, merged
batches handing every request its own rows and errors, the 413/422/500/503 answers, the body limit, health. The
app is driven in-process."""

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
from stppo_envs.retrieval.server import BodyLimit, ServerLimits, _Batcher, create_app
from tests.support.retrieval_server import _Backend
from tests.support.retrievers import KeywordRetriever

PASSAGES = [(f"T{i}", f"passage {i} about paris") for i in range(6)]


# --- driving the ASGI app without a server -------------------------------------------------------------------

def _scope(method, path, headers):
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1234)}


async def _call(app, method, path, body: bytes = b"", chunks=None, declare_length=True):
    """One request; returns (status, headers, body bytes). ``chunks`` sends the body in pieces without a length."""
    pieces = list(chunks) if chunks is not None else [body]
    headers = [(b"content-type", b"application/json")]
    if chunks is None and declare_length:
        headers.append((b"content-length", str(len(body)).encode()))
    pulled = 0
    never = asyncio.Event()

    async def receive():
        nonlocal pulled
        if pulled < len(pieces):
            pulled += 1
            return {"type": "http.request", "body": pieces[pulled - 1], "more_body": pulled < len(pieces)}
        await never.wait()  # the client stays connected

    sent = []

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(app(_scope(method, path, headers), receive, send), timeout=10)  # a lost request fails
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], start["headers"], body


def _post_all(app, payloads, concurrent=False):
    """POST each payload to /retrieve in one event loop (the batcher lives in the loop that first used it)."""
    async def run():
        calls = [_call(app, "POST", "/retrieve", json.dumps(p).encode()) for p in payloads]
        if concurrent:
            return await asyncio.gather(*calls)
        return [await call for call in calls]

    return [(status, json.loads(body)) for status, _, body in asyncio.run(run())]


def _post(app, payload):
    return _post_all(app, [payload])[0]


def _app(retriever=None, **limits):
    return create_app(retriever if retriever is not None else KeywordRetriever(PASSAGES), ServerLimits(**limits))


# --- limits and answers ----------------------------------------------------------------------------------------

def test_server_limits_defaults():
    assert ServerLimits() == ServerLimits(max_queries=16384, max_topk=100, max_query_chars=16384,
                                          max_body_bytes=64 * 1024 * 1024, default_topk=3, batch_window_s=0.002,
                                          max_batch_queries=4096)


def test_topk_defaults_to_the_limits_default_and_is_bounded_on_both_sides():
    app = _app(max_topk=4, default_topk=2)
    answers = _post_all(app, [{"queries": ["paris"]}, {"queries": ["paris"], "topk": 1},
                              {"queries": ["paris"], "topk": 4}, {"queries": ["paris"], "topk": 0},
                              {"queries": ["paris"], "topk": 5}])
    assert [status for status, _ in answers] == [200, 200, 200, 422, 422]
    assert [len(body["result"][0]) for _, body in answers[:3]] == [2, 1, 4]
    assert answers[3][1]["detail"] == "topk must be between 1 and 4, got 0"
    assert answers[4][1]["detail"] == "topk must be between 1 and 4, got 5"


def test_the_query_count_limit_admits_exactly_max_queries():
    app = _app(max_queries=3)
    (ok, body), (refused, detail) = _post_all(app, [{"queries": ["a"] * 3, "topk": 1}, {"queries": ["a"] * 4}])
    assert ok == 200 and len(body["result"]) == 3
    assert refused == 413 and detail["detail"] == "at most 3 queries per request, got 4"


def test_the_query_length_limit_admits_exactly_max_chars_and_names_the_first_five_offenders():
    app = _app(max_query_chars=5, max_queries=10)
    answers = _post_all(app, [{"queries": ["paris", "12345"], "topk": 1},
                              {"queries": ["ok", "123456", "ok"]},
                              {"queries": ["toolong"] * 7}])
    assert answers[0][0] == 200
    assert answers[1] == (422, {"detail": "queries [1] are longer than 5 characters"})
    assert answers[2] == (422, {"detail": "queries [0, 1, 2, 3, 4] are longer than 5 characters"})


def test_invalid_unicode_is_refused_naming_the_first_five_offenders():
    app = _app()

    async def run():  # json.dumps escapes a lone surrogate as \ud800, which the server decodes to one
        bodies = [json.dumps({"queries": ["ok", "\ud800"]}), json.dumps({"queries": ["\udfff x"] * 6 + ["ok"]})]
        return [await _call(app, "POST", "/retrieve", body.encode()) for body in bodies]

    (s1, _, b1), (s2, _, b2) = asyncio.run(run())
    assert (s1, json.loads(b1)["detail"]) == (422, "queries [1] are not valid Unicode (lone surrogate code points)")
    assert (s2, json.loads(b2)["detail"]) == (422, "queries [0, 1, 2, 3, 4] are not valid Unicode (lone surrogate "
                                                   "code points)")


def test_answers_carry_documents_with_or_without_scores():
    app = _app(KeywordRetriever([("Paris", "Paris is the capital of France.")]))
    (s1, scored), (s2, bare) = _post_all(app, [{"queries": ["capital france"], "topk": 1, "return_scores": True},
                                               {"queries": ["capital france"], "topk": 1}])
    document = {"id": "0", "contents": '"Paris"\nParis is the capital of France.'}
    assert scored == {"result": [[{"document": document, "score": 1.0}]]}
    assert bare == {"result": [[document]]} and s1 == s2 == 200


class _Picky(KeywordRetriever):
    """Refuses any batch holding a query with BAD in it (as Lucene does a query of too many clauses)."""

    def batch_search(self, queries, k=10):
        if any("BAD" in q for q in queries):
            raise RetrievalError(f"refused {len(queries)}")
        return super().batch_search(queries, k)


def test_refused_queries_are_listed_in_order_with_empty_rows():
    status, body = _post(_app(_Picky(PASSAGES)), {"queries": ["BAD 0", "paris 0", "BAD 2"], "topk": 1})
    assert status == 200 and body["result"][0] == [] and body["result"][2] == []
    assert body["result"][1][0]["id"] == "0"
    assert body["errors"] == [{"index": 0, "type": "RetrievalError", "message": "refused 1"},
                              {"index": 2, "type": "RetrievalError", "message": "refused 1"}]


class _Down(KeywordRetriever):
    def batch_search(self, queries, k=10):
        raise RetrieverUnavailableError("upstream gone")


def test_a_backend_that_is_down_answers_503_and_a_server_bug_500():
    assert _post(_app(_Down()), {"queries": ["a"]}) == (503, {"detail": "retrieval failed: upstream gone"})
    app = _app()

    async def broken(queries, k):
        raise ValueError("bug in the batcher")

    app.app.state.batcher.search = broken
    assert _post(app, {"queries": ["a"]}) == (500, {"detail": "retrieval failed: ValueError: bug in the batcher"})


def test_health_reports_the_retriever_and_what_was_served():
    class Named(KeywordRetriever):
        index_id = "idx-123"

        def __repr__(self):
            return "Named()"

    app = _app(_Picky(PASSAGES))
    named = _app(Named(PASSAGES))

    async def run():
        await _call(app, "POST", "/retrieve", json.dumps({"queries": ["paris", "BAD", "x"], "topk": 1}).encode())
        await _call(app, "POST", "/retrieve", json.dumps({"queries": ["paris"], "topk": 2}).encode())
        return (await _call(app, "GET", "/health"))[2], (await _call(named, "GET", "/health"))[2]

    health, named_health = (json.loads(b) for b in asyncio.run(run()))
    assert health["status"] == "ok" and health["index_id"] is None and health["retriever"].startswith("<")
    assert (health["queries_served"], health["batches_served"]) == (3, 2)  # the refused query is not counted
    assert named_health == {"status": "ok", "retriever": "Named()", "index_id": "idx-123", "queries_served": 0,
                            "batches_served": 0}


def test_the_app_names_itself_in_its_openapi_description():
    async def run():
        return (await _call(_app(), "GET", "/openapi.json"))[2]

    info = json.loads(asyncio.run(run()))["info"]
    assert info["title"] == "stppo retrieval server" and info["description"] == "Search-R1-compatible /retrieve"


def _gather(batcher, requests_):
    async def run():
        return await asyncio.wait_for(asyncio.gather(*(batcher.search(q, k) for q, k in requests_)), timeout=10)

    return asyncio.run(run())


def test_a_merged_batch_stops_growing_at_max_batch_queries():
    backend = _Backend()
    batcher = _Batcher(backend, ServerLimits(batch_window_s=0.5, max_batch_queries=3))
    answers = _gather(batcher, [(["a", "b"], 1), (["c"], 1), (["d"], 1), (["e", "f", "g"], 1)])
    assert [queries for queries, _ in backend.calls] == [["a", "b", "c"], ["d", "e", "f", "g"]]
    assert [[row[0].docid for row in rows] for rows, _ in answers] == [["a#0", "b#0"], ["c#0"], ["d#0"],
                                                                       ["e#0", "f#0", "g#0"]]
    assert batcher.batches_served == 2 and batcher.queries_served == 7


def test_requests_apart_by_more_than_the_window_are_not_merged():
    backend = _Backend()
    batcher = _Batcher(backend, ServerLimits(batch_window_s=0.01))

    async def run():
        first = asyncio.ensure_future(batcher.search(["a"], 1))
        await asyncio.sleep(0.3)
        second = await asyncio.wait_for(batcher.search(["b"], 1), timeout=10)
        return await asyncio.wait_for(first, timeout=10), second

    asyncio.run(run())
    assert [queries for queries, _ in backend.calls] == [["a"], ["b"]]


def test_a_failure_inside_a_group_fails_its_requests_and_the_batcher_keeps_serving():
    class Broken(_Batcher):
        async def _serve_group(self, group, k):
            if k == 2:
                raise KeyError("bug")
            await super()._serve_group(group, k)

    backend = _Backend()
    batcher = Broken(backend, ServerLimits(batch_window_s=0.2))

    async def run():  # a request the batcher forgets fails the test instead of hanging it
        answers = await asyncio.wait_for(asyncio.gather(batcher.search(["a"], 2), batcher.search(["b"], 1),
                                                        return_exceptions=True), timeout=10)
        return answers, await asyncio.wait_for(batcher.search(["c"], 1), timeout=10)

    (broken, served), later = asyncio.run(run())
    assert isinstance(broken, KeyError) and served[0][0][0].docid == "b#0" and later[0][0][0].docid == "c#0"


def test_a_down_backend_fails_only_the_requests_it_could_not_serve():
    class HalfDown(_Backend):
        def batch_search(self, queries, k=10):
            if k == 2:
                raise RetrieverUnavailableError("down for k=2")
            return super().batch_search(queries, k)

    batcher = _Batcher(HalfDown(), ServerLimits(batch_window_s=0.2))

    async def run():
        return await asyncio.wait_for(asyncio.gather(batcher.search(["a"], 2), batcher.search(["b", "c"], 1),
                                                     return_exceptions=True), timeout=10)

    down, (rows, errors) = asyncio.run(run())
    assert isinstance(down, RetrieverUnavailableError) and errors == {}
    assert [row[0].docid for row in rows] == ["b#0", "c#0"]


# --- the body limit ----------------------------------------------------------------------------------------------

def _body_of(n):
    """A valid request body of exactly n bytes (JSON padded with spaces)."""
    body = json.dumps({"queries": ["paris"], "topk": 1})
    assert len(body) <= n
    return (body + " " * (n - len(body))).encode()


def test_the_body_limit_admits_exactly_the_limit_declared_or_chunked():
    app = _app(max_body_bytes=100)

    async def run():
        return [await _call(app, "POST", "/retrieve", _body_of(100)),
                await _call(app, "POST", "/retrieve", _body_of(101)),
                await _call(app, "POST", "/retrieve", chunks=[_body_of(100)[:50], _body_of(100)[50:]]),
                await _call(app, "POST", "/retrieve", chunks=[_body_of(101)[:50], _body_of(101)[50:]]),
                await _call(app, "POST", "/retrieve", _body_of(101), declare_length=False)]

    answers = asyncio.run(run())
    assert [status for status, _, _ in answers] == [200, 413, 200, 413, 413]
    for status, headers, body in answers:
        if status == 413:
            assert json.loads(body) == {"detail": "request body over 100 bytes"}
            assert headers == [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                               (b"connection", b"close")]


def test_a_refused_upload_gets_one_answer_and_the_app_sees_a_client_that_left():
    seen = []

    async def app(scope, receive, send):
        while True:
            message = await receive()
            seen.append(message["type"])
            if message["type"] == "http.disconnect":
                seen.append((await receive())["type"])  # asking again: still gone, nothing more is read
                await send({"type": "http.response.start", "status": 200, "headers": []})
                raise RuntimeError("the app fails on the disconnect; the 413 stands")

    limited = BodyLimit(app, 10)
    status, _, body = asyncio.run(_call(limited, "POST", "/x", chunks=[b"x" * 6, b"x" * 6, b"x" * 6]))
    assert status == 413 and json.loads(body) == {"detail": "request body over 10 bytes"}
    assert seen == ["http.request", "http.disconnect", "http.disconnect"]  # it stopped reading at the limit


def test_the_body_limit_passes_other_scopes_through_and_reraises_app_errors():
    calls = []

    async def app(scope, receive, send):
        calls.append((scope["type"], (await receive())["type"]))
        if scope["type"] == "http":
            raise RuntimeError("app bug")
        await send({"type": "lifespan.startup.complete"})

    limited = BodyLimit(app, 10)

    async def nothing():
        return {"type": "lifespan.startup"}

    sent = []

    async def record(message):
        sent.append(message)

    asyncio.run(limited({"type": "lifespan"}, nothing, record))
    assert sent == [{"type": "lifespan.startup.complete"}]
    with pytest.raises(RuntimeError, match="app bug"):
        asyncio.run(_call(limited, "POST", "/x", b"{}"))
    assert calls == [("lifespan", "lifespan.startup"), ("http", "http.request")]


def test_serve_runs_uvicorn_on_loopback_with_the_limited_app(monkeypatch):
    import uvicorn

    from stppo_envs.retrieval import server

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append((app, kwargs)))
    server.serve(KeywordRetriever())
    server.serve(KeywordRetriever(), host="0.0.0.0", port=9001, limits=ServerLimits(max_body_bytes=7),
                 log_level="warning")
    (default_app, default_kwargs), (app, kwargs) = calls
    assert isinstance(app.app.state.batcher.retriever, KeywordRetriever)
    assert default_kwargs == {"host": "127.0.0.1", "port": 8000, "log_level": "info"}
    assert isinstance(default_app, BodyLimit) and default_app.limit == 64 * 1024 * 1024
    assert kwargs == {"host": "0.0.0.0", "port": 9001, "log_level": "warning"} and app.limit == 7


def test_a_zero_window_serves_every_request_on_its_own():
    backend = _Backend()
    batcher = _Batcher(backend, ServerLimits(batch_window_s=0.0))

    async def run():
        first = await asyncio.wait_for(batcher.search(["a"], 1), timeout=10)
        second = await asyncio.wait_for(batcher.search(["b", "c"], 1), timeout=10)
        return first, second

    (rows_a, _), (rows_bc, _) = asyncio.run(run())
    assert [row[0].docid for row in rows_a + rows_bc] == ["a#0", "b#0", "c#0"]
    assert backend.calls == [(["a"], 1), (["b", "c"], 1)] and batcher.batches_served == 2


def test_a_declared_length_over_the_limit_is_refused_before_reading_the_body():
    async def app(scope, receive, send):
        raise AssertionError("the app must not be called")

    pulled = []

    async def receive():
        pulled.append(1)
        return {"type": "http.request", "body": b"x" * 11, "more_body": False}

    sent = []

    async def send(message):
        sent.append(message)

    scope = _scope("POST", "/x", [(b"content-type", b"application/json"), (b"content-length", b"11")])
    asyncio.run(BodyLimit(app, 10)(scope, receive, send))
    assert pulled == [] and sent[0]["status"] == 413


class _Refusing(_Backend):
    """Raises ``error`` for any batch holding a query that contains BAD."""

    def __init__(self, error):
        super().__init__()
        self.error = error

    def batch_search(self, queries, k=10):
        if any("BAD" in q for q in queries):
            self.calls.append((list(queries), k))
            raise self.error
        return super().batch_search(queries, k)


@pytest.mark.parametrize("error", [RetrievalError("refused"), ValueError("faiss: bad input")])
def test_merged_requests_get_their_own_errors_at_their_own_positions(error):
    batcher = _Batcher(_Refusing(error), ServerLimits(batch_window_s=0.3))
    asked = [(["a0", "a1"], 1), (["BAD b0", "b1"], 1), (["c0", "c1", "BAD c2"], 1), (["d0"], 1)]
    answers = _gather(batcher, asked)
    expected_bad = [[], [0], [2], []]
    for (queries, _), (rows, errors), bad in zip(asked, answers, expected_bad):
        assert sorted(errors) == bad, queries
        assert [None if row is None else row[0].docid for row in rows] == \
               [None if i in bad else f"{q}#0" for i, q in enumerate(queries)]
        assert all(str(error) in str(e) for e in errors.values())
    assert batcher.queries_served == 8 - 2 and batcher.batches_served == 1


# The retrieval server: a query the backend refuses is that query's failure, never the batch's, and a merged request
# hands every client exactly its own rows.


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


class _FailingOnBadBackend:
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
    backend = _FailingOnBadBackend()
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
    backend = _FailingOnBadBackend(error)
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
    batcher = _Batcher(_FailingOnBadBackend(RetrieverUnavailableError("upstream server down")), ServerLimits())
    (answer,) = _served(batcher, [(["BAD x", "y"], 2)])
    assert isinstance(answer, RetrieverUnavailableError)


def test_a_backend_returning_the_wrong_number_of_rows_hands_out_no_rows():
    class Short(_FailingOnBadBackend):
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

    class Partial(_FailingOnBadBackend):  # answers as a remote client does when the server refused some queries
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
    down = _FailingOnBadBackend(RetrieverUnavailableError("down"))
    rows, errors = search_each(down, [f"BAD {i}" for i in range(64)], 1)
    assert rows == [None] * 64 and len(errors) == 64


def test_search_each_finds_a_refused_query_in_few_calls():
    from stppo_envs.retrieval import search_each

    backend = _FailingOnBadBackend(RetrievalError("refused"))
    queries = [f"q{i}" for i in range(1024)]
    queries[700] = "BAD"
    rows, errors = search_each(backend, queries, 1)
    assert list(errors) == [700] and rows[699][0].docid == "q699#0" and rows[701][0].docid == "q701#0"
    assert len(backend.calls) <= 2 * 10 + 1  # halving: about two calls per level of a 1,024-query batch
