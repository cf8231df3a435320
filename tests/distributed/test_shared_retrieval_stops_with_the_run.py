"""A training run's shared retrieval server stops with the run, even when the run is killed (torchrun sends
SIGTERM, then SIGKILL: atexit never runs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.support.paths import REPO
from tests.support.processes import alive, gone_within

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal")

PARENT = """
import json, sys, time
sys.path.insert(0, {repo!r})
from stppo_agent.distributed.shared_retrieval import spawn_tied_to_this_process, start_server
if sys.argv[1] == "server":
    print(json.dumps({{"url": start_server("demo", __import__("pathlib").Path(sys.argv[2]))}}), flush=True)
else:
    child = spawn_tied_to_this_process([sys.executable, "-c", sys.argv[2]])
    print(json.dumps({{"pid": child.pid}}), flush=True)
time.sleep(600)
"""


def start_parent(*args: str) -> tuple[subprocess.Popen, dict]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(repo=str(REPO)), *args], stdout=subprocess.PIPE,
                              text=True)
    line = parent.stdout.readline()
    assert line, "the parent process failed to start its child"
    return parent, json.loads(line)


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_child_stops_when_its_parent_is_killed(tied, tmp_path):
    ready = tmp_path / "ready"
    tie = "from stppo_agent.distributed.shared_retrieval import stop_with_parent; stop_with_parent(); "
    body = (tie if tied else "") + \
        f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    parent, started = start_parent("child", f"import sys; sys.path.insert(0, {str(REPO)!r}); {body}")
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:  # the child is past its start-up
            time.sleep(0.1)
        assert ready.exists()
        parent.kill()  # SIGKILL: no atexit, no handler
        parent.wait()
        assert gone_within(started["pid"], 5) is tied  # untied, it outlives its parent (what the tie is for)
    finally:
        if alive(started["pid"]):
            os.kill(started["pid"], signal.SIGKILL)


def test_the_shared_retrieval_server_stops_when_the_training_process_is_killed(tmp_path):
    parent, started = start_parent("server", str(tmp_path))
    url = started["url"]
    assert requests.get(url + "/health", timeout=5).ok
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            requests.get(url + "/health", timeout=1)
        except requests.ConnectionError:
            return
        time.sleep(0.2)
    port = url.rsplit(":", 1)[1]
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):  # do not leave it running
        try:
            if cmdline.read_bytes().split(b"\0")[-3:-1] == [b"--port", port.encode()]:
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    pytest.fail("the retrieval server outlived the killed training process")
