"""One retrieval server per node for the ranks of a data-parallel run, started by the node's first process.

Loading a BM25 index (a JVM each) or a dense index (tens of GB of vectors each) in every training process
wastes memory; with ``distributed.share_retriever`` (the default) and a local retriever spec, the process with
LOCAL_RANK 0 on each node starts ``stppo serve`` on a free loopback port, that node's ranks talk to it over HTTP, and it
stops with the run.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from stppo_agent.distributed import process_group
from stppo_agent.distributed.process_group import free_port


def is_local_spec(spec) -> bool:
    return isinstance(spec, str) and not spec.startswith(("http://", "https://"))


PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_ENV = "STPPO_STOP_WITH_PID"


def spawn_tied_to_this_process(command: list[str], **popen_kwargs) -> subprocess.Popen:
    """``Popen`` of a child that stops when this process dies, however it dies (Linux; the child calls
    :func:`stop_with_parent` at start-up).

    atexit never runs when a training process is killed -- torchrun stops its workers with SIGTERM, then SIGKILL --
    and a retrieval server left behind holds its index in memory (a JVM, or tens of GB of vectors) and its port.
    Elsewhere the child only stops on a normal exit. (Not ``preexec_fn``: it is unsafe in a process with threads,
    as a trainer is.)
    """
    env = {**popen_kwargs.pop("env", os.environ), PARENT_ENV: str(os.getpid())}
    return subprocess.Popen(command, env=env, **popen_kwargs)


def stop_with_parent() -> None:
    """In a child started by :func:`spawn_tied_to_this_process`: have the kernel send SIGTERM when the parent
    dies (the parent is the thread that started this process, i.e. the trainer's main thread)."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def start_server(spec: str, run_dir: Path, timeout: float = 600.0) -> str:
    """Start ``stppo serve --retriever spec`` and wait until it answers; returns its URL."""
    port = free_port()
    log = open(run_dir / "retrieval_server.log", "w")
    process = spawn_tied_to_this_process([sys.executable, "-m", "stppo_agent.cli", "serve", "--retriever", spec,
                                          "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    atexit.register(_stop, process)  # a normal exit; a killed one is covered by spawn_tied_to_this_process
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the shared retrieval server for {spec!r} exited; see {run_dir}/retrieval_server.log")
        try:
            if requests.get(f"{url}/health", timeout=2).ok:
                (run_dir / "retrieval_server.json").write_text(json.dumps({"spec": spec, "url": url}) + "\n")
                return url
        except requests.RequestException:
            time.sleep(0.5)
    _stop(process)
    raise RuntimeError(f"the shared retrieval server for {spec!r} did not start within {timeout:.0f} s")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def shared_retriever_spec(spec, run_dir: Path):
    """The spec every rank should use: its node's server URL for a local spec in a multi-process run.

    The first process of each node (LOCAL_RANK 0) starts a server on loopback; ranks find their node's URL by
    host name, so several nodes never talk to each other's loopback addresses.
    """
    if process_group.world_size() <= 1 or not is_local_spec(spec):
        return spec
    run_dir.mkdir(parents=True, exist_ok=True)
    local_rank = int(os.environ.get("LOCAL_RANK", process_group.rank()))
    url = start_server(spec, run_dir) if local_rank == 0 else None
    host = socket.gethostname()
    urls = [u for h, u in process_group.all_gather_objects((host, url)) if h == host and u]
    if not urls:
        raise RuntimeError(f"no process on {host} started the shared retrieval server (is LOCAL_RANK set?)")
    return urls[0]
