"""The `stppo` commands of a study, each in a process of its own, forked from one server that imported the CLI and
the trainer once.

The stability and stress studies run dozens of short `stppo` commands. Started as new interpreters, each paid about
6 s of CPU importing torch, transformers and datasets before doing anything (the quick study spent most of its
2.4 CPU minutes there; a toy-tier stress run trains for well under a minute). multiprocessing's fork server is a fresh,
single-threaded process that imports them once; forking it is safe, unlike forking the study itself, which may hold
torch's thread pools or a JVM. Each command still runs alone in its own process, as a user's would: its memory,
threads, random state and JVM start from the server's clean state and end with it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

PRELOAD = ["stppo_agent.cli", "stppo_agent.training.trainer"]  # the CLI first: it sets torch's allocator options
_context: multiprocessing.context.BaseContext | None = None


def _fork_server() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _command(argv: list[str], log: str) -> None:
    """In the forked process: the command's stdout and stderr (Python's and any library's) go to ``log``; `ps` and
    `top` show it as ``stppo COMMAND`` (the fork server's command line is all it has otherwise)."""
    with contextlib.suppress(OSError):  # Linux; elsewhere the name stays python's
        Path("/proc/self/comm").write_text(f"stppo {argv[0]}"[:15])
    fd = os.open(log, os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from stppo_agent.cli import main

    try:
        code = main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def run_stppo(argv: Sequence[str]) -> None:
    """Run ``stppo ARGV`` to its end; a failure raises RuntimeError with the tail of the command's output. If the
    caller is stopped meanwhile (SystemExit from SIGTERM, KeyboardInterrupt), the command is killed with it."""
    with tempfile.NamedTemporaryFile(prefix="stppo-command-", suffix=".log") as log:
        process = _fork_server().Process(target=_command, args=(list(argv), log.name), name=f"stppo {argv[0]}")
        process.start()
        try:
            process.join()
        finally:
            if process.exitcode is None:
                process.kill()
                process.join()
        if process.exitcode:
            tail = Path(log.name).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"stppo {' '.join(argv)} failed (exit code {process.exitcode}):\n{tail}")
