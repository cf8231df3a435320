"""``stppo_envs.retrieval.remote``: the HTTP client -- its URL, chunked requests,
per-query errors at the caller's positions, statuses, retries, parsing and pickling."""

from __future__ import annotations

import http.server
import json
import pickle
import threading

import pytest

from stppo_envs.retrieval import Hit, RetrievalError, RetrieverUnavailableError
from stppo_envs.retrieval.base import PartialSearchError
from stppo_envs.retrieval.remote import RemoteRetriever


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
