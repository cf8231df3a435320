"""`stppo` commands run in the test's own process, for tests where what a command does and prints is the point, not
how a process starts (each new `stppo` process pays ~6 s of CPU importing torch, transformers and datasets)."""

from __future__ import annotations

import subprocess


def stppo(*args: str, capsys) -> subprocess.CompletedProcess:
    """``stppo ARGS`` through the CLI's own entry point; its exit code and output as a finished process's."""
    from stppo_agent.cli import main

    capsys.readouterr()
    code = main(list(args))
    said = capsys.readouterr()
    return subprocess.CompletedProcess(["stppo", *args], code, said.out, said.err)
