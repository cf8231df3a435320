"""`stppo compare` knows a retriever by what it searches, not by how it was reached: a local and a
served evaluation of one index compare without --force; another index, or a server that does not say what it
serves, is still refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stppo_agent.distributed.process_group import free_port
from stppo_agent.evaluation.comparison import ProvenanceMismatchError, compare, searched_index_id
from tests.support.cli_in_process import stppo
from tests.support.processes import wait_until_serving


def record(retriever: str, retriever_id: str, topk: int = 3) -> list[dict]:
    return [{"benchmark": "nq", "metrics": {"em": 0.5, "n": 2},
             "provenance": {"agent": "oracle", "retriever": retriever, "retriever_id": retriever_id, "topk": topk}}]


def test_results_written_with_a_remote_prefix_compare_with_the_local_index():
    local = record("bm25:wiki", "bm25:corpus-sha256:ab12")
    served = record("http://127.0.0.1:8000", "remote:bm25:corpus-sha256:ab12")
    assert "0.500  0.500" in compare([local, served], ["local", "served"])
    for other in (record("http://h:1", "remote:http://h:1/retrieve"),  # a server that does not say what it serves
                  record("bm25:wiki", "bm25:corpus-sha256:ffff"),  # another index
                  record("http://127.0.0.1:8000", "remote:bm25:corpus-sha256:ab12", topk=5)):  # another top-k
        with pytest.raises(ProvenanceMismatchError):
            compare([local, other], ["a", "b"])
    assert searched_index_id("remote:remote:dense:abc") == "dense:abc"


def evaluate(retriever: str, out: str, capsys) -> None:
    done = stppo("eval", "--agent", "search-copy", "--benchmarks", "nq", "--retriever", retriever, "--limit", "3",
                 "--output-dir", out, capsys=capsys)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_served_and_a_local_run_of_the_demo_index_compare_and_another_index_does_not(tmp_path, capsys,
                                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)  # the commands name their folders relative to it, as a user's shell would
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "stppo_agent.cli", "serve", "--retriever", "demo", "--port",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_serving(url, server):
            pytest.fail("stppo serve did not start")
        evaluate("demo", "local", capsys)
        evaluate(url, "served", capsys)
    finally:
        server.kill()
        server.wait(timeout=10)
    same = stppo("compare", "local", "served", capsys=capsys)
    assert same.returncode == 0, same.stderr
    assert same.stdout.splitlines()[0].split()[-2:] == ["local", "served"] and "NOT COMPARABLE" not in same.stdout

    corpus = tmp_path / "other.jsonl"
    corpus.write_text('{"id": "1", "contents": "\\"Elsewhere\\"\\nA different corpus about other rivers."}\n')
    built = stppo("index", "bm25", "--corpus", str(corpus), "--out", "other-index", capsys=capsys)
    assert built.returncode == 0, built.stderr[-3000:]
    evaluate("bm25:other-index", "other", capsys)
    refused = stppo("compare", "local", "other", capsys=capsys)
    assert refused.returncode == 1 and "not comparable" in refused.stderr and "retriever_id" in refused.stderr
