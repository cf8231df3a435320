"""Recorders standing in for the library behind the commands, so a command runs in the
test's process with no model, index or training."""

from __future__ import annotations

from pathlib import Path

import pytest

from stppo_agent.cli import main


def plugin_file(tmp_path: Path, tag: str = "") -> Path:
    """An empty plugin file named after the test's own folder: the loader refuses a second file of a module name it
    has imported from another path, which a rerun of the test in the same process would be."""
    path = tmp_path / f"plugin_{tmp_path.name}{tag}.py"
    path.write_text("LOADED = True\n")
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    said = capsys.readouterr()
    return code, said.out, said.err


def usage_error(capsys, *argv: str) -> str:
    """argparse's refusal: exit status 2 and its message on stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(list(argv))
    assert stop.value.code == 2
    return capsys.readouterr().err


class Calls:
    """Stands in for a library function: records each call's arguments and returns ``result``."""

    def __init__(self, result=None):
        self.result = result
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result(*args, **kwargs) if callable(self.result) else self.result

    @property
    def only(self) -> tuple[tuple, dict]:
        assert len(self.calls) == 1, self.calls
        return self.calls[0]
