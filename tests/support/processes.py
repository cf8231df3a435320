"""Child processes seen through Linux /proc (tests that kill a parent and check what it left running)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def descendants(pid: int) -> list[int]:
    """Children, their children and so on, parents before their children."""
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def name(pid: int) -> str:
    """The process's name as `ps` shows it ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def kill_9_once_written(process: subprocess.Popen, path: Path, within: float = 300) -> None:
    """SIGKILL ``process`` as soon as ``path`` exists (a checkpoint it writes); fails if it dies or takes too long."""
    deadline = time.time() + within
    while not path.exists():
        assert process.poll() is None, process.stderr.read().decode()[-2000:] if process.stderr else "it exited"
        assert time.time() < deadline, f"{path} was not written within {within} s"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def wait_until_serving(url: str, process: subprocess.Popen | None = None, within: float = 120) -> bool:
    """Poll ``url``/health until it answers (True), ``process`` exits or ``within`` seconds pass (False)."""
    import requests

    deadline = time.time() + within
    while time.time() < deadline and (process is None or process.poll() is None):
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                return True
        except requests.RequestException:
            time.sleep(0.3)
    return False
