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


# --- the client: RemoteRetriever ---------------------------------------------------------------------------------

from stppo_envs.retrieval.remote import RemoteRetriever  # noqa: E402


class _Response:
    def __init__(self, status=200, body=None, text=None):
        self.status_code, self._body = status, body
        self.text = text if text is not None else json.dumps(body)

    def json(self):
        if self._body is None:
            raise ValueError("not JSON")
        return self._body


class _Session:
    """Stands in for requests.Session: answers each post with the next of ``answers`` (or rows naming the queries)."""

    def __init__(self, answers=()):
        self.answers, self.posts = list(answers), []

    def post(self, url, json=None, timeout=None):
        self.posts.append((url, json, timeout))
        if self.answers:
            return self.answers.pop(0)
        rows = [[{"document": {"id": q, "contents": f'"{q}"\nabout {q}'}, "score": 1.0}] for q in json["queries"]]
        return _Response(body={"result": rows})


def _client(answers=(), **kwargs):
    client = RemoteRetriever("http://stub:1", **kwargs)
    client._session = _Session(answers)
    return client


def test_the_client_url_defaults_and_repr():
    assert RemoteRetriever("http://h:1/").url == "http://h:1/retrieve"
    assert RemoteRetriever("http://h:1/retrieve/").url == "http://h:1/retrieve"
    assert RemoteRetriever("http://h:1/prefiX").url == "http://h:1/prefiX/retrieve"
    client = RemoteRetriever("http://h:1")
    assert (client.timeout, client.retries, client.backoff, client.max_batch) == (30.0, 2, 0.2, 512)
    assert repr(client) == "RemoteRetriever('http://h:1/retrieve')"


def test_the_client_posts_search_r1_requests_in_chunks_of_max_batch():
    client = _client(max_batch=2, timeout=7.5)
    rows = client.batch_search(["a", "b", "c", "d", "e"], 4)
    assert [url for url, _, _ in client._session.posts] == ["http://stub:1/retrieve"] * 3
    assert [payload for _, payload, _ in client._session.posts] == [
        {"queries": ["a", "b"], "topk": 4, "return_scores": True}, {"queries": ["c", "d"], "topk": 4,
                                                                    "return_scores": True},
        {"queries": ["e"], "topk": 4, "return_scores": True}]
    assert {timeout for _, _, timeout in client._session.posts} == {7.5}
    assert [row[0].docid for row in rows] == ["a", "b", "c", "d", "e"] and rows[0][0] == Hit("a", 1.0, "a", "about a")
    assert client.batch_search([], 3) == [] and len(client._session.posts) == 3
    client.batch_search(["z"])
    assert client._session.posts[-1][1]["topk"] == 10  # the default k is pyserini's 10


def _rows(n):
    return [[{"document": {"id": str(i), "contents": f'"T{i}"\ntext {i}'}, "score": float(i)}] for i in range(n)]


def test_per_query_errors_come_back_at_the_callers_positions():
    answers = [_Response(body={"result": _rows(2)}),
               _Response(body={"result": _rows(2), "errors": [{"index": 1, "type": "E", "message": "refused"}]})]
    client = _client(answers, max_batch=2)
    with pytest.raises(PartialSearchError) as caught:
        client.batch_search(["a", "b", "c", "d"], 1)
    assert list(caught.value.errors) == [3] and caught.value.results[3] is None
    assert [row[0].docid for row in caught.value.results[:3]] == ["0", "1", "0"]
    assert str(caught.value.errors[3]) == "retrieval server http://stub:1/retrieve: refused"
    alone = _client([_Response(body={"result": [[]], "errors": [{"index": 0, "message": "too many clauses"}]})])
    with pytest.raises(RetrievalError) as single:
        alone.search("q", 1)
    assert type(single.value) is RetrievalError
    assert str(single.value) == "retrieval server http://stub:1/retrieve: too many clauses"


@pytest.mark.parametrize("status, kind, words", [
    (500, RetrieverUnavailableError, "failed (500)"), (503, RetrieverUnavailableError, "failed (503)"),
    (499, RetrievalError, "rejected the request (499)"), (400, RetrievalError, "rejected the request (400)")])
def test_error_statuses_map_to_unavailable_or_refused(status, kind, words):
    client = _client([_Response(status, text="e" * 400)])
    with pytest.raises(RetrievalError) as caught:
        client.search("q", 1)
    assert type(caught.value) is kind
    assert str(caught.value) == f"retrieval server http://stub:1/retrieve {words}: " + "e" * 300


def test_a_request_that_cannot_be_sent_is_unavailable():
    import requests

    class Refusing(_Session):
        def post(self, url, json=None, timeout=None):
            raise requests.ConnectionError("connection refused")

    client = RemoteRetriever("http://stub:1")
    client._session = Refusing()
    with pytest.raises(RetrieverUnavailableError, match=r"^retrieval server http://stub:1/retrieve unreachable: "
                                                        r"connection refused$"):
        client.search("q", 1)


@pytest.mark.parametrize("answer, words", [
    (_Response(body=None, text="<html>"), "sent an unexpected answer"),
    (_Response(body={"rows": []}), "sent an unexpected answer"),
    (_Response(body={"result": [[{"document": "x"}]]}), "sent an unexpected answer"),
    (_Response(body={"result": _rows(1)}), "sent 1 rows (errors at []) for 2 queries"),
    (_Response(body={"result": _rows(3)}), "sent 3 rows (errors at []) for 2 queries"),
    (_Response(body={"result": _rows(2), "errors": [{"index": 2, "message": "m"}]}), "sent 2 rows (errors at [2])"),
    (_Response(body={"result": _rows(2), "errors": [{"index": -1, "message": "m"}]}), "sent 2 rows (errors at [-1])"),
])
def test_answers_that_do_not_match_the_request_are_refused(answer, words):
    with pytest.raises(RetrievalError) as caught:
        _client([answer]).batch_search(["a", "b"], 1)
    assert type(caught.value) is RetrievalError and words in str(caught.value)


def test_results_parse_scored_bare_and_split_documents():
    items = [{"document": {"id": 7, "contents": '"Paris"\nCapital.'}, "score": 2.5},
             {"id": "8", "contents": "Rome\nEternal."},
             {"docid": "9", "title": "Oslo", "text": "Cold."},
             {"document": {"title": "Nowhere"}}, {"document": {"id": "10", "text": "Only text."}}]
    (row,) = _client([_Response(body={"result": [items]})]).batch_search(["q"], 5)
    assert row == [Hit("7", 2.5, "Paris", "Capital."), Hit("8", 0.0, "Rome", "Eternal."),
                   Hit("9", 0.0, "Oslo", "Cold."), Hit("", 0.0, "Nowhere", ""), Hit("10", 0.0, "", "Only text.")]
    assert row[1].title_line == "Rome" and row[0].title_line == '"Paris"'


class _Stub(http.server.BaseHTTPRequestHandler):
    """A scripted HTTP server: answers with the next (status, body) of ``script``; counts the hits per path."""

    script: list = []
    hits: dict = {}

    def _answer(self):
        type(self).hits[self.path] = type(self).hits.get(self.path, 0) + 1
        if self.command == "POST":
            self.rfile.read(int(self.headers["content-length"]))
        status, body = self.script.pop(0) if self.script else (200, {"result": _rows(1)})
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    _Stub.script, _Stub.hits = [], {}
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("statuses, retries, hits, served", [
    ([502, 504], 2, 3, True), ([503, 503, 503], 2, 3, False), ([503], 0, 1, False), ([500], 2, 1, False)])
def test_the_client_retries_502_503_504_up_to_retries_times(stub, statuses, retries, hits, served):
    _Stub.script = [(status, {"detail": "busy"}) for status in statuses]
    client = RemoteRetriever(stub, retries=retries, backoff=0)
    if served:
        assert client.search("q", 1)[0].docid == "0"
    else:
        with pytest.raises(RetrieverUnavailableError):
            client.search("q", 1)
    assert _Stub.hits == {"/retrieve": hits}


def test_the_session_mounts_one_pooled_retrying_adapter_for_http_and_https():
    session = RemoteRetriever("http://h:1", retries=3, backoff=0.5).session
    for scheme in ("http://h", "https://h"):
        adapter = session.get_adapter(scheme)
        retry = adapter.max_retries
        assert (retry.total, retry.connect, retry.read, retry.backoff_factor) == (3, 3, 3, 0.5)
        assert tuple(retry.status_forcelist) == (502, 503, 504) and set(retry.allowed_methods) == {"POST"}
        assert adapter.poolmanager.connection_pool_kw["maxsize"] == 64
    assert RemoteRetriever("http://h:1").session is not None


def test_index_id_comes_from_health_once_and_falls_back_to_the_url(stub):
    _Stub.script = [(200, {"status": "ok", "index_id": "abc123"})]
    client = RemoteRetriever(stub + "/retrieve")
    assert client.index_id == "remote:abc123" and client.index_id == "remote:abc123"
    assert _Stub.hits == {"/health": 1}
    for answer in [(200, {"status": "ok"}), (200, {"index_id": None}), (200, b"not json"), (404, ["x"])]:
        _Stub.script = [answer]
        assert RemoteRetriever(stub).index_id == f"remote:{stub}/retrieve", answer


def test_a_pickled_client_reopens_its_session_and_asks_for_its_index_again(stub):
    _Stub.script = [(200, {"index_id": "one"})]
    client = RemoteRetriever(stub, timeout=3.0, retries=1, max_batch=9)
    assert client.index_id == "remote:one" and client._session is not None
    clone = pickle.loads(pickle.dumps(client))
    assert clone._session is None and clone.__dict__["_index_id"] is None
    assert (clone.url, clone.timeout, clone.retries, clone.max_batch) == (client.url, 3.0, 1, 9)
    _Stub.script = [(200, {"index_id": "two"})]
    assert clone.index_id == "remote:two" and clone.search("q", 1)[0].docid == "0"


# --- the retriever protocol: base.py -----------------------------------------------------------------------------

from stppo_envs.retrieval import base  # noqa: E402


def test_hits_keep_the_stored_title_line_or_quote_the_title():
    assert base.Hit("1", 0.0, "Paris", "A city.").contents == '"Paris"\nA city.'
    assert base.Hit("1", 0.0, "Paris", "A city.", title_line="Paris").contents == "Paris\nA city."
    assert base.Hit("1", 0.0, "Paris", "x", title_line="Paris") == base.Hit("1", 0.0, "Paris", "x")  # not compared
    hit = base.hit_from_contents("7", 1.5, "Arkansas\nA state.\nMore.")
    assert (hit.docid, hit.score, hit.title, hit.text, hit.title_line) == ("7", 1.5, "Arkansas", "A state.\nMore.",
                                                                            "Arkansas")
    bare = base.hit_from_contents("8", 0.0, "no title line")
    assert (bare.title, bare.text, bare.title_line, bare.display_title) == ("", "no title line", None, '""')


@pytest.mark.parametrize("contents, parsed", [
    ('"Paris"\nCapital.', ("Paris", "Capital.")), ('  "Paris"  \nCapital.', ("Paris", "Capital.")),
    ('"\nx', ('"', "x")), ('""\nx', ("", "x")), ('"a\nx', ('"a', "x")), ("Rome\nx\ny", ("Rome", "x\ny")),
    ("alone", ("", "alone"))])
def test_parse_contents_unquotes_only_a_fully_quoted_title(contents, parsed):
    assert base.parse_contents(contents) == parsed


def test_passages_sha256_covers_ids_contents_order_and_boundaries():
    one = base.passages_sha256([("1", "a"), ("2", "b")])
    import hashlib

    expected = hashlib.sha256(b'["1", "a"]\n["2", "b"]\n').hexdigest()
    assert one == expected
    assert base.passages_sha256([(1, "\u00e9")]) == hashlib.sha256('["1", "\u00e9"]\n'.encode()).hexdigest()
    assert base.passages_sha256([]) == hashlib.sha256(b"").hexdigest()


def test_portable_name_drops_machine_directories(tmp_path):
    assert base.portable_name("/x/y/gt_model/model") == "gt_model/model"
    assert base.portable_name("/x/y/idx/index") == "idx/index" and base.portable_name("/x/y/e/encoder") == "e/encoder"
    assert base.portable_name("/x/y/some-index") == "some-index"
    assert base.portable_name("org/enc") == "org/enc"
    (tmp_path / "rel").mkdir()
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert base.portable_name("rel") == "rel" and base.portable_name("rel/model") == "rel/model"
    finally:
        os.chdir(cwd)


def test_sanitize_query_and_is_valid_unicode():
    assert base.is_valid_unicode("caf\u00e9") and not base.is_valid_unicode("a\ud800")
    assert base.sanitize_query(" a\x00b\x1fc\x7fd\te\nf\rg\x0bh\x0ci ") == "a b c d\te\nf\rg h i"
    assert base.sanitize_query("x\udfffy") == "x\ufffdy" and base.sanitize_query(" \x00 ") == "?"
    assert base.sanitize_query("\x08\x0e") == "?" and base.sanitize_query("ok") == "ok"


def test_error_types_nest_as_documented():
    assert issubclass(base.IndexNotFoundError, base.RetrievalError) and issubclass(base.IndexNotFoundError,
                                                                                   FileNotFoundError)
    assert issubclass(base.RetrieverUnavailableError, ConnectionError)
    assert issubclass(base.RetrievalError, RuntimeError)


def test_partial_search_error_messages_and_order():
    single = PartialSearchError([None], {0: RetrievalError("too many clauses")})
    assert str(single) == "too many clauses"
    several = PartialSearchError([None, [], None], {2: RetrievalError("late"), 0: RetrievalError("first")})
    assert str(several) == "2 of 3 queries failed; query 0: first"
    assert list(several.errors) == [0, 2] and several.results == [None, [], None]
    two = PartialSearchError([[], None], {1: RetrievalError("x")})
    assert str(two) == "1 of 2 queries failed; query 1: x"


def test_as_retrieval_error_names_a_foreign_exception():
    error = RetrievalError("mine")
    assert base.as_retrieval_error(error) is error
    wrapped = base.as_retrieval_error(ValueError("bad input"))
    assert type(wrapped) is RetrievalError and str(wrapped) == "ValueError: bad input"


class _Refuses(_Backend):
    """Refuses any batch holding a query with BAD in it, with ``error``."""

    def __init__(self, error=None):
        super().__init__()
        self.error = error or RetrievalError("refused")

    def batch_search(self, queries, k=10):
        self.calls.append((list(queries), k))
        if any("BAD" in q for q in queries):
            raise self.error
        return [[Hit(f"{q}#{j}", 0.0, q, "") for j in range(k)] for q in queries]


def test_search_each_splits_in_halves_down_to_the_refused_query():
    backend = _Refuses()
    rows, errors = search_each(backend, ["a", "b", "BAD", "d", "e"], 2)
    assert list(errors) == [2] and str(errors[2]) == "refused" and rows[2] is None
    assert [row[1].docid for i, row in enumerate(rows) if i != 2] == ["a#1", "b#1", "d#1", "e#1"]
    assert [queries for queries, _ in backend.calls] == [["a", "b", "BAD", "d", "e"], ["a", "b"], ["BAD", "d", "e"],
                                                         ["BAD"], ["d", "e"]]
    assert {k for _, k in backend.calls} == {2}
    rows, errors = search_each(_Refuses(), ["x", "BAD"], 1)
    assert list(errors) == [1] and rows[0][0].docid == "x#0"
    assert search_each(_Refuses(), [], 1) == ([], {})


def test_search_each_isolates_only_what_it_is_told_to():
    with pytest.raises(ValueError):  # a bug in the backend is not a refused query by default
        search_each(_Refuses(ValueError("bug")), ["BAD", "b"], 1)
    for queries in (["a", "BAD"], ["BAD", "b"], ["a", "BAD", "c", "d", "e"], ["a", "b", "c", "BAD"]):
        rows, errors = search_each(_Refuses(ValueError("bug")), queries, 1, isolate=Exception)  # in either half
        bad = queries.index("BAD")
        assert list(errors) == [bad] and str(errors[bad]) == "ValueError: bug", queries
        assert [row[0].docid for i, row in enumerate(rows) if i != bad] == [f"{q}#0" for q in queries if q != "BAD"]


def test_search_each_fails_every_query_at_once_when_the_backend_is_down():
    backend = _Refuses(RetrieverUnavailableError("down"))
    rows, errors = search_each(backend, ["BAD", "b", "c"], 1)
    assert rows == [None, None, None] and list(errors) == [0, 1, 2] and len(backend.calls) == 1
    assert all(str(e) == "down" for e in errors.values())


def test_search_each_keeps_a_partial_answer_as_it_came():
    class Partial(_Backend):
        def batch_search(self, queries, k=10):
            self.calls.append(queries)
            raise PartialSearchError([None, [Hit("b", 0.0, "", "")]], {0: RetrievalError("no")})

    backend = Partial()
    rows, errors = search_each(backend, ["a", "b"], 1)
    assert rows == [None, [Hit("b", 0.0, "", "")]] and list(errors) == [0] and len(backend.calls) == 1


def test_search_each_refuses_rows_that_do_not_match_the_queries():
    class Long(_Backend):
        def batch_search(self, queries, k=10):
            return super().batch_search(list(queries) + ["extra"], k)

    rows, errors = search_each(Long(), ["a", "b"], 1)
    assert rows == [None, None] and str(errors[1]) == "the backend returned 3 rows for 2 queries"


def test_batch_search_mixin_search_is_the_first_row():
    class Mixed(base.BatchSearchMixin):
        def batch_search(self, queries, k=10):
            return [[Hit(q, float(k), "", "")] for q in queries] + [["never"]]

    assert Mixed().search("q") == [Hit("q", 10.0, "", "")] and Mixed().search("q", 2)[0].score == 2.0


def test_the_cache_asks_the_backend_once_per_distinct_query_and_k():
    backend = _Backend()
    cached = CachedRetriever(backend)
    assert cached.maxsize == 65536
    rows = cached.batch_search(["a", "b", "a"], 1)
    assert [row[0].docid for row in rows] == ["a#0", "b#0", "a#0"] and backend.calls == [(["a", "b"], 1)]
    assert cached.search("a", 2)[0].docid == "a#0" and backend.calls[-1] == (["a"], 2)  # another k: asked again
    assert cached.batch_search(["b", "a"], 1) == [rows[1], rows[0]] and len(backend.calls) == 2
    assert cached.batch_search([], 1) == [] and len(backend.calls) == 2


def test_the_cache_evicts_the_least_recently_used_beyond_maxsize_and_pickles_its_size():
    backend = _Backend()
    cached = CachedRetriever(backend, maxsize=2)
    cached.batch_search(["a", "b"], 1)
    cached.search("a", 1)  # a is now the most recent
    cached.search("c", 1)  # evicts b
    backend.calls.clear()
    cached.batch_search(["a", "c", "b"], 1)
    assert backend.calls == [(["b"], 1)]
    clone = pickle.loads(pickle.dumps(cached))
    assert clone.maxsize == 2 and clone._cache.maxsize == 2 and len(clone._cache) == 0
    assert isinstance(clone.retriever, _Backend) and repr(clone) == f"CachedRetriever({clone.retriever!r})"


def test_the_cache_names_its_backends_index():
    class Named(_Backend):
        index_id = "bm25:abc"

    assert CachedRetriever(Named()).index_id == "bm25:abc"
    backend = _Backend()
    assert CachedRetriever(backend).index_id == repr(backend)


def test_reopens_after_pickling_drops_only_the_transient_attributes():
    class Holder(base.ReopensAfterPickling):
        _transient = ("_handle", "_other")

        def __init__(self):
            self.path, self._handle, self._other = "p", object(), 1

    state = Holder().__getstate__()
    assert state == {"path": "p", "_handle": None, "_other": None}
    holder = Holder()
    holder.__getstate__()
    assert holder._handle is not None  # the live object keeps its handle
    assert base.ReopensAfterPickling._transient == ()


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
