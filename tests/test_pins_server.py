"""Pins for the retrieval server, its client and the retriever protocol (server.py, remote.py, base.py): the
limits at their boundaries, what a merged batch hands each request, the 413/422/500/503 answers, the body
limit, the client's URL, chunking, retries and parsing (issue 27). The app is driven at the ASGI level and the
client against a stub HTTP server in a thread, so no test starts a process or loads an index."""

from __future__ import annotations

import asyncio
import http.server
import json
import pickle
import threading

import pytest

from stppo_envs.retrieval import Hit, RetrievalError, RetrieverUnavailableError
from stppo_envs.retrieval.base import CachedRetriever, PartialSearchError, search_each
from stppo_envs.retrieval.server import BodyLimit, ServerLimits, _Batcher, create_app

from .conftest import KeywordRetriever

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

    await app(_scope(method, path, headers), receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], start["headers"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


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


# --- the batcher -------------------------------------------------------------------------------------------------

class _Backend:
    """Rows that name their query and k; records every call."""

    def __init__(self):
        self.calls: list[tuple[list[str], int]] = []

    def batch_search(self, queries, k=10):
        self.calls.append((list(queries), k))
        return [[Hit(f"{q}#{j}", float(k - j), q, "") for j in range(k)] for q in queries]

    def search(self, query, k=10):
        return self.batch_search([query], k)[0]


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
        second = await batcher.search(["b"], 1)
        return await first, second

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

    async def run():
        answers = await asyncio.gather(batcher.search(["a"], 2), batcher.search(["b"], 1), return_exceptions=True)
        return answers, await batcher.search(["c"], 1)

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
        return await asyncio.gather(batcher.search(["a"], 2), batcher.search(["b", "c"], 1), return_exceptions=True)

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
            assert headers == [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]


def test_a_refused_upload_gets_one_answer_and_the_app_sees_a_client_that_left():
    seen = []

    async def app(scope, receive, send):
        while True:
            message = await receive()
            seen.append(message["type"])
            if message["type"] == "http.disconnect":
                await send({"type": "http.response.start", "status": 200, "headers": []})
                raise RuntimeError("the app fails on the disconnect; the 413 stands")

    limited = BodyLimit(app, 10)
    status, _, body = asyncio.run(_call(limited, "POST", "/x", chunks=[b"x" * 6, b"x" * 6, b"x" * 6]))
    assert status == 413 and json.loads(body) == {"detail": "request body over 10 bytes"}
    assert seen == ["http.request", "http.disconnect"]  # it stopped reading at the limit


def test_the_body_limit_passes_other_scopes_through_and_reraises_app_errors():
    calls = []

    async def app(scope, receive, send):
        calls.append(scope["type"])
        if scope["type"] == "http":
            raise RuntimeError("app bug")

    limited = BodyLimit(app, 10)

    async def nothing():
        return {"type": "lifespan.startup"}

    async def ignore(message):
        pass

    asyncio.run(limited({"type": "lifespan"}, nothing, ignore))
    with pytest.raises(RuntimeError, match="app bug"):
        asyncio.run(_call(limited, "POST", "/x", b"{}"))
    assert calls == ["lifespan", "http"]


def test_serve_runs_uvicorn_on_loopback_with_the_limited_app(monkeypatch):
    import uvicorn

    from stppo_envs.retrieval import server

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append((app, kwargs)))
    server.serve(KeywordRetriever())
    server.serve(KeywordRetriever(), host="0.0.0.0", port=9001, limits=ServerLimits(max_body_bytes=7),
                 log_level="warning")
    (default_app, default_kwargs), (app, kwargs) = calls
    assert default_kwargs == {"host": "127.0.0.1", "port": 8000, "log_level": "info"}
    assert isinstance(default_app, BodyLimit) and default_app.limit == 64 * 1024 * 1024
    assert kwargs == {"host": "0.0.0.0", "port": 9001, "log_level": "warning"} and app.limit == 7
