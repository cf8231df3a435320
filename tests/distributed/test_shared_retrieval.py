"""``stppo_agent.distributed.shared_retrieval``: one retrieval server
per node -- the command, its health check and record, a server that exits or never answers, stop, and a child
that dies with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import requests

from stppo_agent.distributed import shared_retrieval as sr
from tests.support.fakes import Calls


# -- shared_retrieval ------------------------------------------------------------------------------------------------
def test_shared_retrieval_local_specs():
    assert sr.is_local_spec("bm25:/idx") and sr.is_local_spec("demo")
    assert not sr.is_local_spec("http://h:1") and not sr.is_local_spec("https://h")
    assert not sr.is_local_spec(object()) and not sr.is_local_spec(None)
    assert (sr.PR_SET_PDEATHSIG, sr.PARENT_ENV) == (1, "STPPO_STOP_WITH_PID")


def test_shared_retrieval_a_child_is_told_its_parent(monkeypatch):
    calls = Calls()
    monkeypatch.setattr(subprocess, "Popen", calls.fn("popen", "process"))
    monkeypatch.setenv("SOME_SETTING", "kept")
    assert sr.spawn_tied_to_this_process(["cmd", "x"], stdout=1) == "process"
    (_, args, kwargs), = calls
    assert args == (["cmd", "x"],) and kwargs["stdout"] == 1
    assert kwargs["env"]["STPPO_STOP_WITH_PID"] == str(os.getpid()) and kwargs["env"]["SOME_SETTING"] == "kept"
    assert "STPPO_STOP_WITH_PID" not in os.environ
    sr.spawn_tied_to_this_process(["cmd"], env={"ONLY": "this"})
    assert calls[-1][2] == {"env": {"ONLY": "this", "STPPO_STOP_WITH_PID": str(os.getpid())}}


def test_shared_retrieval_a_child_asks_the_kernel_for_sigterm_when_its_parent_dies(monkeypatch):
    import ctypes

    calls = Calls()
    libc = SimpleNamespace(prctl=calls.fn("prctl"))
    monkeypatch.setattr(ctypes, "CDLL", calls.fn("cdll", libc))
    monkeypatch.setattr(os, "kill", calls.fn("kill"))
    monkeypatch.delenv("STPPO_STOP_WITH_PID", raising=False)
    sr.stop_with_parent()
    assert calls == []
    monkeypatch.setenv("STPPO_STOP_WITH_PID", str(os.getppid()))
    sr.stop_with_parent()
    assert calls == [("cdll", (None,), {"use_errno": True}), ("prctl", (1, signal.SIGTERM), {})]
    assert "STPPO_STOP_WITH_PID" not in os.environ  # its own children are not tied to its parent
    calls.clear()
    monkeypatch.setenv("STPPO_STOP_WITH_PID", str(os.getppid() + 100000))
    sr.stop_with_parent()
    assert calls[-1] == ("kill", (os.getpid(), signal.SIGTERM), {})
    calls.clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv("STPPO_STOP_WITH_PID", "1")
    sr.stop_with_parent()
    assert calls == [] and "STPPO_STOP_WITH_PID" not in os.environ


class _Process:
    def __init__(self, exits_after=None, hangs=False):
        self.polls, self.exits_after, self.hangs, self.log = 0, exits_after, hangs, []

    def poll(self):
        self.polls += 1
        return 1 if self.exits_after is not None and self.polls > self.exits_after else None

    def terminate(self):
        self.log.append("terminate")

    def wait(self, timeout):
        self.log.append(("wait", timeout))
        if self.hangs:
            raise subprocess.TimeoutExpired("serve", timeout)

    def kill(self):
        self.log.append("kill")


@pytest.fixture
def server_recorders(monkeypatch):
    calls = Calls()
    monkeypatch.setattr(sr, "free_port", lambda: 5151)
    monkeypatch.setattr(sr.atexit, "register", calls.fn("atexit"))
    monkeypatch.setattr(sr.time, "sleep", calls.fn("sleep"))
    return calls


def test_shared_retrieval_the_server_command_its_health_check_and_record(tmp_path, monkeypatch, server_recorders):
    process = _Process()
    monkeypatch.setattr(sr, "spawn_tied_to_this_process", server_recorders.fn("spawn", process))
    answers = iter([requests.ConnectionError("not yet"), SimpleNamespace(ok=False), SimpleNamespace(ok=True)])

    def get(url, timeout):
        server_recorders.append(("get", (url,), {"timeout": timeout}))
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(sr.requests, "get", get)
    assert sr.start_server("bm25:/idx", tmp_path) == "http://127.0.0.1:5151"
    spawn = server_recorders[0]
    assert spawn[1] == ([sys.executable, "-m", "stppo_agent.cli", "serve", "--retriever", "bm25:/idx", "--port",
                         "5151"],)
    assert spawn[2]["stdout"].name == str(tmp_path / "retrieval_server.log") and spawn[2]["stderr"] == \
        subprocess.STDOUT
    assert server_recorders[1] == ("atexit", (sr._stop, process), {})
    assert [c for c in server_recorders[2:]] == [
        ("get", ("http://127.0.0.1:5151/health",), {"timeout": 2}), ("sleep", (0.5,), {}),
        ("get", ("http://127.0.0.1:5151/health",), {"timeout": 2}),
        ("get", ("http://127.0.0.1:5151/health",), {"timeout": 2})]
    assert (tmp_path / "retrieval_server.json").read_text() == \
        '{"spec": "bm25:/idx", "url": "http://127.0.0.1:5151"}\n'


def test_shared_retrieval_a_server_that_exits_or_never_answers(tmp_path, monkeypatch, server_recorders):
    monkeypatch.setattr(sr, "spawn_tied_to_this_process", lambda *a, **k: _Process(exits_after=1))
    monkeypatch.setattr(sr.requests, "get", lambda url, timeout: SimpleNamespace(ok=False))
    with pytest.raises(RuntimeError, match=r"^the shared retrieval server for 'bm25:/i' exited; see "
                                           + str(tmp_path) + "/retrieval_server.log$"):
        sr.start_server("bm25:/i", tmp_path)
    hanging = _Process()
    monkeypatch.setattr(sr, "spawn_tied_to_this_process", lambda *a, **k: hanging)
    clock = iter([100.0, 100.0, 101.0, 102.5])  # the deadline itself is past it
    monkeypatch.setattr(sr.time, "time", lambda: next(clock))
    with pytest.raises(RuntimeError, match=r"^the shared retrieval server for 'dense:/d' did not start within 2 s$"):
        sr.start_server("dense:/d", tmp_path, timeout=2.5)
    assert hanging.log == ["terminate", ("wait", 10)]
    clock = iter([0.0, 0.0, 700.0])
    monkeypatch.setattr(sr.time, "time", lambda: next(clock))
    with pytest.raises(RuntimeError, match=r"did not start within 600 s$"):  # the default: an index may load slowly
        sr.start_server("dense:/d", tmp_path)
    assert not (tmp_path / "retrieval_server.json").exists()


def test_shared_retrieval_stop_terminates_then_kills():
    running, stubborn, done = _Process(), _Process(hangs=True), _Process(exits_after=0)
    sr._stop(running)
    sr._stop(stubborn)
    sr._stop(done)
    assert running.log == ["terminate", ("wait", 10)]
    assert stubborn.log == ["terminate", ("wait", 10), "kill"]
    assert done.log == []


def test_shared_retrieval_each_node_uses_its_first_process_server(tmp_path, monkeypatch):
    calls = Calls()
    monkeypatch.setattr(sr.process_group, "world_size", lambda: 2)
    monkeypatch.setattr(sr.process_group, "rank", lambda: 1)
    monkeypatch.setattr(sr, "start_server", calls.fn("start", "http://127.0.0.1:7000"))
    monkeypatch.setattr(sr.socket, "gethostname", lambda: "node-b")
    gathered = []

    def gather(value):
        gathered.append(value)
        return [("node-a", "http://127.0.0.1:6000"), ("node-a", None), value, ("node-b", None)]

    monkeypatch.setattr(sr.process_group, "all_gather_objects", gather)
    run_dir = tmp_path / "run" / "deep"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert sr.shared_retriever_spec("bm25:/idx", run_dir) == "http://127.0.0.1:7000"
    assert calls == [("start", ("bm25:/idx", run_dir), {})] and run_dir.is_dir()
    assert gathered == [("node-b", "http://127.0.0.1:7000")]
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match=r"^no process on node-b started the shared retrieval server \(is "
                                           r"LOCAL_RANK set\?\)$"):
        sr.shared_retriever_spec("bm25:/idx", run_dir)
    assert gathered[-1] == ("node-b", None) and len(calls) == 1
    monkeypatch.delenv("LOCAL_RANK")  # then the global rank: 1, not the first process
    with pytest.raises(RuntimeError):
        sr.shared_retriever_spec("bm25:/idx", run_dir)
    monkeypatch.setattr(sr.process_group, "rank", lambda: 0)
    assert sr.shared_retriever_spec("bm25:/idx", run_dir) == "http://127.0.0.1:7000"
    assert sr.shared_retriever_spec("http://remote:1", run_dir) == "http://remote:1"
    monkeypatch.setattr(sr.process_group, "world_size", lambda: 1)
    assert sr.shared_retriever_spec("bm25:/idx", tmp_path / "single") == "bm25:/idx"
    assert not (tmp_path / "single").exists() and len(calls) == 2
