"""Every command and flag the README and --help show exists, and --help shows defaults (issue 13)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from stppo_agent.cli import _parser, main

REPO = Path(__file__).resolve().parents[1]


def _subparsers(parser):
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


def documented_commands() -> list[str]:
    """`stppo ...` command lines of the README's code blocks, continuation lines joined."""
    blocks, current, language = [], None, ""
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("```"):
            if current is None:
                current, language = [], line[3:].strip()
            else:
                if language in ("", "bash", "sh"):
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        joined = re.sub(r"\n\s+(?=\[|--)", " ", joined)  # a synopsis wrapped onto indented lines
        for line in joined.splitlines():
            line = line.strip()
            for match in re.finditer(r"(?:^|[;&|]\s*)(stppo [a-z]+ [^#;&|]*)", line):
                commands.append(match.group(1).strip())
            if line.startswith("torchrun") and "stppo_agent.cli" in line:
                commands.append("stppo " + line.split("stppo_agent.cli", 1)[1].strip())
    return commands


def test_the_readme_shows_commands():
    assert len(documented_commands()) >= 8


@pytest.mark.parametrize("command", documented_commands())
def test_every_documented_flag_exists(command):
    tokens = shlex.split(command.replace("[", " ").replace("]", " ").replace("...", " "))
    assert tokens[0] == "stppo"
    parser = _subparsers(_parser())[tokens[1]]
    if tokens[1] == "index":
        parser = _subparsers(parser)[tokens[2]]
    known = {option for action in parser._actions for option in action.option_strings}
    for token in tokens[2:]:
        if token.startswith("--"):
            assert token.split("=")[0] in known, f"{command}: {token} is not an option of stppo {tokens[1]}"


@pytest.mark.parametrize("command, shown", [(["eval"], "(default: 3)"), (["index", "bm25"], "(default: 1)"),
                                            (["serve"], "(default: 8000)"), (["train"], "actor_lr=1e-6")])
def test_help_shows_defaults(command, shown, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert shown in out
    assert "lr=1e-6," not in out.replace("actor_lr=1e-6", "")


def test_third_party_noise_is_hidden_unless_verbose(tmp_path):
    import subprocess
    import sys

    def run(*extra):
        command = [sys.executable, "-m", "stppo_agent.cli", *extra, "eval", "--agent", "search-copy", "--benchmarks",
                   "nq", "--limit", "2", "--output-dir", str(tmp_path / "out")]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)

    quiet = run()
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "INFO" not in quiet.stderr and "MemorySegmentIndexInput" not in quiet.stderr, quiet.stderr[-2000:]
    assert "EM/acc" in quiet.stdout
    verbose = run("--verbose")
    assert verbose.returncode == 0 and "MemorySegmentIndexInput" in verbose.stderr
