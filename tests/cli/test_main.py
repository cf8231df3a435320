"""The ``stppo`` command itself (stppo_agent/cli/__init__.py): its parser and commands, exit
statuses, ``--verbose``, one-line library errors, a collapse stop's exit 3."""

from __future__ import annotations

import argparse
import os

import pytest

from stppo_agent.cli import build_parser, main
from stppo_agent.cli.arguments import Parser
from tests.support.cli_calls import Calls, run

# ---------------------------------------------------------------- the package: build_parser and main


def test_cli_parser_program_commands_and_verbose_flag():
    parser = build_parser()
    assert parser.prog == "stppo" and isinstance(parser, Parser)
    assert parser.description == "The ``stppo`` command (``python -m stppo_agent.cli`` is the same)."
    assert parser.format_help().startswith("usage: stppo [-h] [--verbose]")
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert [a.dest for a in commands._choices_actions] == ["demo", "sft", "train", "replay", "eval", "index",
                                                           "serve", "compare", "plot", "export"]  # --help order
    args = parser.parse_args(["plot", "r", "--out", "o"])
    assert args.command == "plot" and args.verbose is False
    assert parser.parse_args(["--verbose", "plot", "r", "--out", "o"]).verbose is True
    assert parser.parse_args([]).command is None


def test_cli_no_command_prints_the_help_and_exits_2(capsys):
    code, out, _ = run(capsys)
    assert code == 2 and out.startswith("usage: stppo") and "{demo,sft,train,replay,eval" in out


def test_cli_exit_status_is_the_handlers_or_0(monkeypatch, capsys, run_folders):
    from stppo_agent.runs import plots

    monkeypatch.setattr(plots, "plot_runs", Calls([]))
    assert run(capsys, "plot", "r", "--out", "o")[0] == 0
    from stppo_agent.cli import plot

    monkeypatch.setattr(plot, "run", lambda args: 5)
    assert run(capsys, "plot", "r", "--out", "o")[0] == 5  # a handler's own status passes through


def test_cli_verbose_reaches_the_libraries(monkeypatch, capsys, run_folders):
    from stppo_agent.runs import plots

    monkeypatch.setattr(plots, "plot_runs", Calls([]))
    run(capsys, "plot", "r", "--out", "o")
    assert "STPPO_VERBOSE" not in os.environ and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    run(capsys, "--verbose", "plot", "r", "--out", "o")
    assert os.environ["STPPO_VERBOSE"] == "1" and "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ


def _failing_plot(monkeypatch, exc):
    from stppo_agent.runs import plots

    def fail(*_args):
        raise exc

    monkeypatch.setattr(plots, "plot_runs", fail)


def test_cli_library_errors_are_one_line_and_exit_1(monkeypatch, capsys, run_folders):
    from stppo_agent.runs.checkpoint import CorruptCheckpointError
    from stppo_agent.training.ppo_update import TrainingDivergedError
    from stppo_envs.retrieval import RetrievalError

    cases = [
        (ValueError("bad value,\n  see   the docs"), "bad value, see the docs"),
        (FileNotFoundError(2, "No such file or directory", "r/metrics.jsonl"),
         "[Errno 2] No such file or directory: 'r/metrics.jsonl'"),  # str(), not the errno alone
        (KeyError("no metric 'x'"), "no metric 'x'"),  # the message, not KeyError's quoted repr
        (KeyError(), ""),
        (RetrievalError("index gone"), "index gone"),
        (CorruptCheckpointError("sha mismatch"), "sha mismatch"),
        (TrainingDivergedError("nan loss"), "nan loss"),
        (ConnectionError("refused"), "refused"),
        (PermissionError("denied"), "denied"),
    ]
    for exc, message in cases:
        _failing_plot(monkeypatch, exc)
        code, out, err = run(capsys, "plot", "r", "--out", "o")
        assert (code, out, err) == (1, "", f"stppo plot: error: {message}\n"), exc


def test_cli_a_collapse_stop_exits_3_and_a_bug_is_not_swallowed(monkeypatch, capsys, run_folders):
    from stppo_agent.monitoring.collapse_guard import CollapseStopped

    _failing_plot(monkeypatch, CollapseStopped("entropy collapse at iteration 4"))
    assert run(capsys, "plot", "r", "--out", "o") == (3, "", "stppo plot: stopped: entropy collapse at iteration 4\n")
    _failing_plot(monkeypatch, RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["plot", "r", "--out", "o"])
