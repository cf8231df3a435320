"""Pins for the command line (issue 27, the cli slice): what each command hands the library -- every option's name,
default, type and choices, the handler's arguments, exit codes and the one-line messages -- checked in-process with
the library calls replaced by recorders (no model, no index, no training). The help texts: test_pins_cli_help.py.

Tests are named ``test_<module>_...`` after the cli module they guard (``test_cli_`` for the package's own
``build_parser`` and ``main``)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from stppo_agent.cli import build_parser, main
from stppo_agent.cli.arguments import HelpFormatter, Parser, key_value, positive_int
from stppo_agent.training.config_sections import OptimizerConfig


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


@pytest.fixture(autouse=True)
def _quiet_environment(monkeypatch):
    """No STPPO_VERBOSE from the caller's shell, and the libraries' log levels back as they were afterwards (every
    `main` call sets them)."""
    from datasets.utils import logging as ds_logging
    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("STPPO_VERBOSE", "")  # recorded, so a command that sets it has it removed afterwards
    monkeypatch.delenv("STPPO_VERBOSE")
    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    saved = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), ds_logging.get_verbosity(),
             ds_logging.is_progress_bar_enabled())
    yield
    hf_logging.set_verbosity(saved[0])
    hf_logging.enable_progress_bar() if saved[1] else hf_logging.disable_progress_bar()
    ds_logging.set_verbosity(saved[2])
    ds_logging.enable_progress_bar() if saved[3] else ds_logging.disable_progress_bar()


# ---------------------------------------------------------------- arguments


def test_arguments_positive_int_accepts_one_and_refuses_zero_and_below():
    assert positive_int("1") == 1 and positive_int("12") == 12
    for text, value in (("0", 0), ("-3", -3)):
        with pytest.raises(argparse.ArgumentTypeError) as refused:
            positive_int(text)
        assert str(refused.value) == f"must be >= 1, got {value}"
    with pytest.raises(ValueError):
        positive_int("two")


def test_arguments_key_value_canonical_benchmark_and_the_rest_of_the_value():
    assert key_value("nq=data/nq") == ("nq", "data/nq")
    assert key_value("HotpotQA=a=b") == ("hotpotqa", "a=b")  # the first '=' splits; the path may hold more
    assert key_value("nq=") == ("nq", "")
    with pytest.raises(ValueError) as refused:
        key_value("nq")
    assert str(refused.value) == "expected BENCH=PATH, got 'nq'"
    with pytest.raises(KeyError, match="did you mean hotpotqa"):
        key_value("hotpotq=x")


def test_arguments_help_formatter_adds_the_default_only_where_it_is_news():
    parser = Parser(prog="p")
    parser.add_argument("--topk", type=int, default=3, help="passages per search")
    parser.add_argument("--bare", type=int, default=5)
    parser.add_argument("--said", default="x", help="default x already")
    parser.add_argument("--needed", required=True, default="r", help="needed")
    parser.add_argument("--none", default=None, help="nothing")
    parser.add_argument("--flag", action="store_true", help="a flag")
    parser.add_argument("--many", action="append", default=[], help="repeatable")
    parser.add_argument("--hidden", default=argparse.SUPPRESS, help="suppressed")
    parser.add_argument("--zero", type=int, default=0, help="zero")
    helps = {a.dest: HelpFormatter("p")._get_help_string(a) for a in parser._actions}
    assert helps["topk"] == "passages per search (default: %(default)s)"
    assert helps["bare"] == "(default: %(default)s)"
    assert helps["zero"] == "zero (default: %(default)s)"  # 0 is a default worth showing (not None/False)
    assert helps["said"] == "default x already"
    assert helps["needed"] == "needed"
    assert helps["none"] == "nothing" and helps["flag"] == "a flag" and helps["many"] == "repeatable"
    assert helps["hidden"] == "suppressed"
    text = " ".join(parser.format_help().split())
    assert "passages per search (default: 3)" in text and "(default: x)" not in text and "zero (default: 0)" in text


def test_arguments_parser_uses_the_formatter_unless_told_otherwise():
    assert Parser(prog="p").formatter_class is HelpFormatter
    assert Parser(prog="p", formatter_class=argparse.RawTextHelpFormatter).formatter_class \
        is argparse.RawTextHelpFormatter
    assert Parser("p", "usage: p").prog == "p"  # positional arguments reach argparse too
    parser = Parser(prog="p", description="d")
    assert parser.prog == "p" and parser.description == "d"
    sub = parser.add_subparsers().add_parser("s")
    assert isinstance(sub, Parser) and sub.formatter_class is HelpFormatter  # sub-commands show defaults too


# ---------------------------------------------------------------- verbosity


def test_verbosity_requested_by_the_flag_or_exactly_stppo_verbose_1(monkeypatch):
    from stppo_agent.cli.verbosity import VERBOSE_ENV, verbose_requested

    assert VERBOSE_ENV == "STPPO_VERBOSE"
    assert verbose_requested(False) is False and verbose_requested(True) is True
    monkeypatch.setenv("STPPO_VERBOSE", "1")
    assert verbose_requested(False) is True
    monkeypatch.setenv("STPPO_VERBOSE", "0")
    assert verbose_requested(False) is False and verbose_requested(True) is True


def test_verbosity_third_party_output_off_and_on(monkeypatch):
    import huggingface_hub.utils as hub_utils
    from datasets.utils import logging as ds_logging
    from transformers.utils import logging as hf_logging

    from stppo_agent.cli.verbosity import set_third_party_output

    monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    # datasets reads the variable once, at its import, and then that setting wins over enable/disable (its
    # documented rule): set in the test's environment (`make mutants` sets it) or by an earlier test before
    # datasets was first imported, it would decide this test. The subject here is our switch, not that rule.
    import importlib

    ds_tqdm = importlib.import_module("datasets.utils.tqdm")  # the module: datasets.utils exports a class tqdm too
    monkeypatch.setattr(ds_tqdm, "HF_DATASETS_DISABLE_PROGRESS_BARS", None)
    hub_was_off = hub_utils.are_progress_bars_disabled()
    try:
        set_third_party_output(False)
        assert "STPPO_VERBOSE" not in os.environ
        assert os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1"
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
        assert hf_logging.get_verbosity() == hf_logging.ERROR and not hf_logging.is_progress_bar_enabled()
        assert ds_logging.get_verbosity() == ds_logging.ERROR and not ds_logging.is_progress_bar_enabled()
        assert hub_utils.are_progress_bars_disabled()

        set_third_party_output(True)
        assert os.environ["STPPO_VERBOSE"] == "1"  # child processes (Lucene's wrapper) inherit it
        assert "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ
        assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
        assert hf_logging.get_verbosity() == hf_logging.WARNING and hf_logging.is_progress_bar_enabled()
        assert ds_logging.get_verbosity() == ds_logging.WARNING and ds_logging.is_progress_bar_enabled()
        assert not hub_utils.are_progress_bars_disabled()
        set_third_party_output(True)  # again (a second command in the process): nothing left to remove is fine
        assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    finally:
        hub_utils.disable_progress_bars() if hub_was_off else hub_utils.enable_progress_bars()


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


@pytest.fixture
def run_folders(tmp_path, monkeypatch):
    """Run folders r, r1 and r2 (each with a metrics.jsonl) in the current folder: `stppo plot` refuses a run
    folder that is not there before the plotting these pins replace."""
    monkeypatch.chdir(tmp_path)
    for name in ("r", "r1", "r2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text('{"step": 1}\n')


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


# ---------------------------------------------------------------- compare, plot


def test_compare_hands_every_file_its_label_and_force(monkeypatch, capsys):
    from stppo_agent.evaluation import comparison
    from stppo_agent.runs import labels

    monkeypatch.setattr(comparison, "load_results", Calls(lambda path: [{"from": path}]))
    monkeypatch.setattr(labels, "distinct_labels", Calls(lambda paths: [p.upper() for p in paths]))
    monkeypatch.setattr(comparison, "compare", Calls("THE TABLE"))
    assert run(capsys, "compare", "a/results.json", "b") == (0, "THE TABLE\n", "")
    assert comparison.compare.only == (([[{"from": "a/results.json"}], [{"from": "b"}]], ["A/RESULTS.JSON", "B"],
                                        False), {})
    run(capsys, "compare", "a", "--force")
    assert comparison.compare.calls[-1][0][2] is True
    assert "required: results" in usage_error(capsys, "compare")


def test_plot_hands_the_runs_and_the_folder_and_prints_each_file(monkeypatch, capsys, run_folders):
    from stppo_agent.runs import plots

    monkeypatch.setattr(plots, "plot_runs", Calls([Path("o/loss.png"), Path("o/reward.png")]))
    assert run(capsys, "plot", "r1", "r2", "--out", "o") == (0, "o/loss.png\no/reward.png\n", "")
    assert plots.plot_runs.only == ((["r1", "r2"], "o"), {})
    assert "--out" in usage_error(capsys, "plot", "r1")
    assert "required: runs" in usage_error(capsys, "plot", "--out", "o")


# ---------------------------------------------------------------- demo


def _demo(monkeypatch):
    from stppo_agent.training import demo

    monkeypatch.setattr(demo, "run_demo", Calls())
    return demo.run_demo


def test_demo_defaults_are_demo_settings_own(monkeypatch, capsys):
    from stppo_agent.cli.demo import DEMO_DEFAULTS
    from stppo_agent.training.demo import DemoSettings

    recorded = _demo(monkeypatch)
    assert run(capsys, "demo") == (0, "", "")
    (settings,), _ = recorded.only
    assert settings == DemoSettings()
    assert DEMO_DEFAULTS == {"iterations": 1, "sft_steps": 8, "limit": 8, "lr": 1.5e-5, "seed": 0,
                             "autocast_dtype": "auto"}
    assert (settings.model, settings.output_dir, settings.on_collapse) == ("smollm2", "runs/demo", "warn")
    assert (settings.seed, settings.autocast_dtype) == (0, "auto")


def test_demo_every_option_reaches_the_settings(monkeypatch, capsys):
    from stppo_agent.training.demo import DemoSettings

    recorded = _demo(monkeypatch)
    assert run(capsys, "demo", "--iterations", "3", "--sft-steps", "0", "--limit", "2", "--model", "tiny",
               "--output-dir", "out", "--lr", "3e-6", "--on-collapse", "rollback", "--seed", "7",
               "--autocast-dtype", "bfloat16")[0] == 0
    assert recorded.only[0][0] == DemoSettings(model="tiny", output_dir="out", iterations=3, sft_steps=0, limit=2,
                                               lr=3e-6, on_collapse="rollback", seed=7, autocast_dtype="bfloat16")
    for choice in ("auto", "none"):
        run(capsys, "demo", "--autocast-dtype", choice)
        assert recorded.calls[-1][0][0].autocast_dtype == choice
    for choice in ("none", "warn", "stop"):
        run(capsys, "demo", "--on-collapse", choice)
        assert recorded.calls[-1][0][0].on_collapse == choice


def test_demo_refuses_what_makes_no_sense(monkeypatch, capsys):
    _demo(monkeypatch)
    assert "must be >= 1" in usage_error(capsys, "demo", "--iterations", "0")
    assert "must be >= 1" in usage_error(capsys, "demo", "--limit", "0")
    assert "invalid int" in usage_error(capsys, "demo", "--sft-steps", "1.5")
    assert "invalid float" in usage_error(capsys, "demo", "--lr", "fast")
    assert "invalid choice" in usage_error(capsys, "demo", "--on-collapse", "panic")
    assert "invalid choice" in usage_error(capsys, "demo", "--autocast-dtype", "float16")
    assert "invalid int" in usage_error(capsys, "demo", "--seed", "one")


# ---------------------------------------------------------------- eval


def _eval(monkeypatch, metrics=None):
    from stppo_agent.evaluation import results

    metrics = metrics or {}
    found = Calls(lambda agent, benchmarks, *_: [{"benchmark": b, "metrics": metrics.get(b, {})} for b in benchmarks])
    monkeypatch.setattr(results, "evaluate_all", found)
    monkeypatch.setattr(results, "write_results", Calls())
    monkeypatch.setattr(results, "format_table", Calls("TABLE"))
    return results


EVAL = ("eval", "--agent", "oracle", "--benchmarks", "nq", "--output-dir", "out")


def test_evaluate_defaults_reach_evaluate_all(monkeypatch, capsys):
    results = _eval(monkeypatch)
    assert run(capsys, *EVAL) == (0, "TABLE\n", "")
    args, kwargs = results.evaluate_all.only
    assert (args, kwargs) == (("oracle", ["nq"], {}, None, None, "demo", 3, 4, 32, 0, 256, None), {})
    written, _ = results.write_results.only
    assert written == ([{"benchmark": "nq", "metrics": {}}], Path("out"))
    assert results.format_table.only == (([{"benchmark": "nq", "metrics": {}}],), {})


def test_evaluate_every_option_reaches_evaluate_all(monkeypatch, capsys, tmp_path):
    results = _eval(monkeypatch)
    plugin = plugin_file(tmp_path)
    code, _, _ = run(capsys, "eval", "--agent", "search-copy", "--benchmarks", " NQ, ,HotpotQA ", "--dataset",
                     "nq=demo", "--dataset", "HotpotQA=data/hp", "--split", "dev", "--limit", "5", "--retriever",
                     "bm25:idx", "--topk", "7", "--max-turns", "2", "--batch-size", "9", "--seed", "11",
                     "--max-new-tokens", "64", "--max-observation-tokens", "700", "--output-dir", str(tmp_path / "o"),
                     "--import", str(plugin))
    assert code == 0
    assert results.evaluate_all.only == (("search-copy", ["nq", "hotpotqa"], {"nq": "demo", "hotpotqa": "data/hp"},
                                          "dev", 5, "bm25:idx", 7, 2, 9, 11, 64, 700), {})
    assert results.write_results.only[0][1] == tmp_path / "o"
    import sys

    assert getattr(sys.modules.get(plugin.stem), "LOADED", False)


def test_evaluate_refusals_name_the_fix(monkeypatch, capsys):
    results = _eval(monkeypatch)
    code, _, err = run(capsys, *EVAL, "--dataset", "hotpotqa=x")
    assert code == 1 and err == ("stppo eval: error: --dataset given for hotpotqa, which --benchmarks (nq) does not "
                                 "include; add it to --benchmarks or drop the --dataset\n")
    code, _, err = run(capsys, "eval", "--agent", "oracle", "--benchmarks", "musique,nq", "--output-dir", "o",
                       "--dataset", "popqa=x", "--dataset", "hotpotqa=y")
    assert code == 1 and err.startswith("stppo eval: error: --dataset given for hotpotqa, popqa, which --benchmarks "
                                        "(musique, nq) does not include")
    code, _, err = run(capsys, *EVAL, "--dataset", "nq=data/nq.jsonl")
    assert code == 1 and err == (
        "stppo eval: error: --dataset nq=... is real data, but no --retriever was given: the default demo corpus "
        "(a fictional encyclopedia) cannot answer it. Pass --retriever bm25:DIR, dense:DIR or http://HOST:PORT "
        "(stppo index bm25 --corpus ... builds one), or --retriever demo to search the demo corpus anyway\n")
    code, _, err = run(capsys, *EVAL, "--retriever", "bm52:idx")
    assert code == 1 and "did you mean bm25?" in err
    assert results.evaluate_all.calls == []  # nothing ran for any of them
    # the demo set named explicitly, or an empty source, is not real data; an explicit retriever serves real data
    for dataset in ("nq=demo", "nq="):
        assert run(capsys, *EVAL, "--dataset", dataset)[0] == 0
    assert run(capsys, *EVAL, "--dataset", "nq=data/nq.jsonl", "--retriever", "demo")[0] == 0
    assert results.evaluate_all.calls[-1][0][5] == "demo"


def test_evaluate_options_refuse_bad_values(monkeypatch, capsys):
    _eval(monkeypatch)
    for flag in ("--topk", "--max-turns", "--batch-size", "--limit", "--max-new-tokens"):
        assert "must be >= 1" in usage_error(capsys, *EVAL, flag, "0"), flag
    assert "invalid int" in usage_error(capsys, *EVAL, "--seed", "x")
    assert "invalid float" in usage_error(capsys, *EVAL, "--max-search-error-rate", "x")
    for missing in ("--agent", "--benchmarks", "--output-dir"):
        argv = list(EVAL)
        del argv[argv.index(missing):argv.index(missing) + 2]
        assert missing in usage_error(capsys, *argv)


def test_evaluate_search_errors_above_the_limit_exit_1(monkeypatch, capsys):
    _eval(monkeypatch, {"nq": {"search_error_rate": 0.02}, "hotpotqa": {"search_error_rate": 0.01}})
    code, out, err = run(capsys, "eval", "--agent", "oracle", "--benchmarks", "nq,hotpotqa", "--output-dir", "o")
    assert code == 1 and out == "TABLE\n"  # results written and shown, the status says they are broken
    assert err == ("stppo eval: error: searches failed (nq 2.0%; limit 1.0%): these scores measure a failing "
                   "retriever, not the agent. Check the retriever (a server that is down?) and rerun; "
                   "--max-search-error-rate raises the limit.\n")
    assert run(capsys, "eval", "--agent", "oracle", "--benchmarks", "nq,hotpotqa", "--output-dir", "o",
               "--max-search-error-rate", "0.5")[0] == 0


def test_evaluate_search_error_verdict_boundary_and_missing_rates(capsys):
    from stppo_agent.cli.evaluate import search_error_verdict

    def result(name, **metrics):
        return {"benchmark": name, "metrics": metrics}

    assert search_error_verdict([result("nq", search_error_rate=0.01)], 0.01) == 0  # at the limit: fine
    assert search_error_verdict([result("nq")], 0.0) == 0  # no searches reported: none failed
    assert capsys.readouterr().err == ""
    rates = [result("nq", search_error_rate=0.5), result("popqa", search_error_rate=0.0),
             result("hotpotqa", search_error_rate=0.125)]
    assert search_error_verdict(rates, 0.1) == 1
    assert "(nq 50.0%, hotpotqa 12.5%; limit 10.0%)" in capsys.readouterr().err


# ---------------------------------------------------------------- export


def test_export_verl_hands_every_option_to_export_verl(monkeypatch, capsys):
    from stppo_agent.integrations.verl import data

    monkeypatch.setattr(data, "export_verl", Calls([Path("o/nq_test.parquet")]))
    assert run(capsys, "export", "verl", "--benchmarks", "nq", "--split", "test", "--out", "o") == \
        (0, "o/nq_test.parquet\n", "")
    assert data.export_verl.only == ((["nq"], "test", "o"), {"dataset": None, "limit": None, "max_turns": 4,
                                                             "reward": "auto", "format_reward": 0.0,
                                                             "question_mark": True, "agent_name": "stppo_env"})
    run(capsys, "export", "verl", "--benchmarks", " nq, ,hotpotqa", "--split", "train", "--out", "p", "--dataset",
        "hub", "--limit", "3", "--max-turns", "2", "--format-reward", "0.1", "--reward", "em", "--no-question-mark",
        "--agent-loop", "stppo_tool_agent")
    assert data.export_verl.calls[-1] == ((["nq", "hotpotqa"], "train", "p"), {
        "dataset": "hub", "limit": 3, "max_turns": 2, "reward": "em", "format_reward": 0.1, "question_mark": False,
        "agent_name": "stppo_tool_agent"})


def test_export_refuses_a_missing_format_or_option(monkeypatch, capsys):
    assert "required: format" in usage_error(capsys, "export")
    assert "invalid choice" in usage_error(capsys, "export", "VERL")
    base = ["export", "verl", "--benchmarks", "nq", "--split", "test", "--out", "o"]
    for missing in ("--benchmarks", "--split", "--out"):
        argv = list(base)
        del argv[argv.index(missing):argv.index(missing) + 2]
        assert missing in usage_error(capsys, *argv)
    for flag in ("--limit", "--max-turns"):
        assert "must be >= 1" in usage_error(capsys, *base, flag, "0")
    assert "invalid float" in usage_error(capsys, *base, "--format-reward", "x")


# ---------------------------------------------------------------- index


def test_index_bm25_hands_corpus_out_threads_and_quiet(monkeypatch, capsys):
    from stppo_envs.retrieval import indexing

    monkeypatch.setattr(indexing, "build_bm25_from_corpus", Calls(Path("idx")))
    assert run(capsys, "index", "bm25", "--corpus", "c.jsonl", "--out", "idx") == \
        (0, "BM25 index written to idx; use it with --retriever bm25:idx\n", "")
    assert indexing.build_bm25_from_corpus.only == (("c.jsonl", "idx"), {"threads": 1, "quiet": True})
    run(capsys, "--verbose", "index", "bm25", "--corpus", "c", "--out", "i", "--threads", "4")
    assert indexing.build_bm25_from_corpus.calls[-1] == (("c", "i"), {"threads": 4, "quiet": False})
    assert "must be >= 1" in usage_error(capsys, "index", "bm25", "--corpus", "c", "--out", "i", "--threads", "0")
    assert "--corpus" in usage_error(capsys, "index", "bm25", "--out", "i")
    assert "--out" in usage_error(capsys, "index", "bm25", "--corpus", "c")
    assert "required: kind" in usage_error(capsys, "index")


def test_index_dense_hands_every_option_to_the_build(monkeypatch, capsys):
    from stppo_envs.retrieval import dense

    monkeypatch.setattr(dense, "build_dense_index", Calls(Path("d")))
    base = ("index", "dense", "--corpus", "c.jsonl", "--encoder", "all-MiniLM-L6-v2", "--out", "d")
    assert run(capsys, *base) == (0, "dense index written to d; use it with --retriever dense:d\n", "")
    assert dense.build_dense_index.only == (("c.jsonl", "d", "all-MiniLM-L6-v2"),
                                            {"index_type": "flat", "shard_size": 4096, "batch_size": 64,
                                             "device": None})
    for kind in ("flat", "hnsw", "ivf"):  # each choice accepted when typed
        run(capsys, *base, "--index-type", kind, "--batch-size", "8", "--shard-size", "100", "--device", "cpu")
        assert dense.build_dense_index.calls[-1][1] == {"index_type": kind, "shard_size": 100, "batch_size": 8,
                                                        "device": "cpu"}
    assert "invalid choice" in usage_error(capsys, *base, "--index-type", "lsh")
    for flag in ("--batch-size", "--shard-size"):
        assert "must be >= 1" in usage_error(capsys, *base, flag, "0")
    for missing in ("--corpus", "--encoder", "--out"):
        argv = list(base)
        del argv[argv.index(missing):argv.index(missing) + 2]
        assert missing in usage_error(capsys, *argv)


# ---------------------------------------------------------------- serve


def assert_warm(retriever):
    assert retriever.searched, "requests accepted before the index was loaded"


class WarmRetriever:
    def __init__(self):
        self.searched = []

    def search(self, query, k):
        self.searched.append((query, k))
        return []


def _serve(monkeypatch):
    import stppo_envs.retrieval as retrieval
    from stppo_agent.distributed import shared_retrieval
    from stppo_envs.retrieval import server

    retriever = WarmRetriever()
    monkeypatch.setattr(retrieval, "make_retriever", Calls(retriever))
    monkeypatch.setattr(server, "serve", Calls(lambda *_: assert_warm(retriever)))
    monkeypatch.setattr(shared_retrieval, "stop_with_parent", Calls())
    return retrieval.make_retriever, server.serve, shared_retrieval.stop_with_parent, retriever


def test_serve_warms_the_retriever_and_serves_with_the_limits(monkeypatch, capsys):
    from stppo_envs.retrieval.server import ServerLimits

    made, served, stop, retriever = _serve(monkeypatch)
    assert run(capsys, "serve", "--retriever", "demo") == (0, "", "")
    assert made.only == (("demo",), {}) and retriever.searched == [("warm up", 1)] and len(stop.calls) == 1
    assert served.only == ((retriever, "127.0.0.1", 8000, ServerLimits()), {})
    assert type(served.only[0][3].max_body_bytes) is int  # a byte count, whole MiB
    assert ServerLimits() == ServerLimits(max_topk=100, max_queries=16384, max_query_chars=16384,
                                          max_body_bytes=64 * 2**20)
    run(capsys, "serve", "--retriever", "bm25:idx", "--host", "0.0.0.0", "--port", "9001", "--max-topk", "5",
        "--max-queries", "6", "--max-query-chars", "7", "--max-body-mb", "3")
    assert made.calls[-1] == (("bm25:idx",), {})
    assert served.calls[-1] == ((retriever, "0.0.0.0", 9001, ServerLimits(max_topk=5, max_queries=6,
                                                                          max_query_chars=7,
                                                                          max_body_bytes=3 * 2**20)), {})


def test_serve_refuses_a_misspelt_retriever_before_loading_anything(monkeypatch, capsys):
    made, served, _, _ = _serve(monkeypatch)
    code, _, err = run(capsys, "serve", "--retriever", "bm52:idx")
    assert code == 1 and "did you mean bm25?" in err and made.calls == [] and served.calls == []
    assert "--retriever" in usage_error(capsys, "serve")
    for flag in ("--port", "--max-topk", "--max-queries", "--max-query-chars", "--max-body-mb"):
        assert "invalid int" in usage_error(capsys, "serve", "--retriever", "demo", flag, "1.5"), flag


# ---------------------------------------------------------------- replay


def _replay(monkeypatch, recorded_plugins=()):
    from stppo_agent.plugins import loader
    from stppo_agent.runs import run_summary
    from stppo_agent.training import replay
    from stppo_agent.training.config import TrainConfig

    monkeypatch.setattr(replay, "recorded_config", Calls(TrainConfig(algo="ppo", plugins=list(recorded_plugins))))
    monkeypatch.setattr(replay, "replay", Calls({"loss": 0.5, "iteration": 2, "note": "text"}))
    monkeypatch.setattr(loader, "load_plugins", Calls())
    monkeypatch.setattr(run_summary, "run_summary", Calls(lambda run_dir, title: f"SUMMARY {run_dir} | {title}"))
    return replay, loader.load_plugins, run_summary.run_summary


def test_replay_defaults_and_the_summary(monkeypatch, capsys):
    replay, loaded, summary = _replay(monkeypatch)
    assert run(capsys, "replay", "runs/a", "--output-dir", "runs/b") == \
        (0, "SUMMARY runs/b | replay of runs/a written to\n", "")
    assert replay.replay.only == (("runs/a", None, "runs/b", [], None), {"resume": False, "overwrite": False})
    assert loaded.calls == [] and replay.recorded_config.calls == []  # nothing to import, no algorithm to check
    run(capsys, "replay", "runs/a", "--output-dir", "runs/b", "--resume")
    assert replay.replay.calls[-1][1] == {"resume": True, "overwrite": False}
    run(capsys, "replay", "runs/a", "--output-dir", "runs/b", "--overwrite")
    assert replay.replay.calls[-1][1] == {"resume": False, "overwrite": True}


def test_replay_options_reach_the_replay(monkeypatch, capsys):
    replay, loaded, _ = _replay(monkeypatch, recorded_plugins=["/abs/rec.py"])
    code, out, _ = run(capsys, "replay", "runs/a", "--output-dir", "runs/b", "--algo", "grpo", "--iterations", "3",
                       "--set", "optimizer.actor_lr=1e-6", "--set", "algorithm.clip_high=0.28", "--import",
                       "my_pkg.algos",
                       "--import", "/abs/rec.py", "--json")
    assert code == 0
    plugins = 'plugins=["/abs/rec.py", "my_pkg.algos"]'  # the recorded run's first, each once; --set after it wins
    assert replay.replay.only == (("runs/a", "grpo", "runs/b", [plugins, "optimizer.actor_lr=1e-6",
                                                                 "algorithm.clip_high=0.28"], 3),
                                  {"resume": False, "overwrite": False})
    assert loaded.calls == [((["/abs/rec.py", "my_pkg.algos"],), {}), ((["/abs/rec.py"],), {})]
    assert replay.recorded_config.calls == [(("runs/a",), {})] * 2  # the plugins of the run being replayed
    assert json.loads(out) == {"loss": 0.5, "iteration": 2}  # --json: the numbers only
    assert "invalid int" in usage_error(capsys, "replay", "r", "--output-dir", "o", "--iterations", "x")
    assert "--output-dir" in usage_error(capsys, "replay", "r")


def test_replay_refuses_an_unknown_algorithm_before_replaying(monkeypatch, capsys):
    replay, _, _ = _replay(monkeypatch)
    code, out, err = run(capsys, "replay", "runs/a", "--output-dir", "runs/b", "--algo", "turn_pp")
    assert code == 1 and "unknown algorithm 'turn_pp' (did you mean turn_ppo?)" in err
    assert replay.replay.calls == []


def test_replay_only_the_main_process_prints(monkeypatch, capsys):
    from stppo_agent.distributed import process_group

    replay, _, summary = _replay(monkeypatch)
    monkeypatch.setattr(process_group, "is_main", lambda: False)
    assert run(capsys, "replay", "runs/a", "--output-dir", "runs/b") == (0, "", "")
    assert len(replay.replay.calls) == 1 and summary.calls == []


# ---------------------------------------------------------------- sft


def _sft(monkeypatch):
    from stppo_agent.models import default_model
    from stppo_agent.plugins import loader
    from stppo_agent.training import sft

    monkeypatch.setattr(sft, "train_sft", Calls({"first_loss": 2.34567, "last_loss": 0.5}))
    monkeypatch.setattr(default_model, "resolve_model", Calls(lambda name: f"resolved/{name}"))
    monkeypatch.setattr(loader, "load_plugins", Calls())
    return sft.train_sft, loader.load_plugins


def test_sft_defaults_are_sftconfigs(monkeypatch, capsys):
    from stppo_agent.training.sft import SFTConfig

    trained, loaded = _sft(monkeypatch)
    assert run(capsys, "sft", "--model", "smollm2", "--output-dir", "out") == \
        (0, "loss 2.346 -> 0.500; saved out\n", "")
    (config,), _ = trained.only
    assert config == SFTConfig(model="resolved/smollm2", output_dir="out", benchmarks=["nq", "hotpotqa"])
    assert (config.teacher, config.split, config.retriever, config.max_turns, config.steps, config.batch_size,
            config.lr, config.dtype, config.autocast_dtype, config.seed, config.limit, config.datasets) == \
        ("gold-search", "train", "demo", 3, 60, 4, 2e-5, "float32", None, 0, None, {})
    assert loaded.only == (([],), {})


def test_sft_every_option_reaches_the_config(monkeypatch, capsys):
    from stppo_agent.training.sft import SFTConfig

    trained, loaded = _sft(monkeypatch)
    code, _, _ = run(capsys, "sft", "--model", "tiny", "--output-dir", "o", "--teacher", "oracle", "--benchmarks",
                     " NQ, popqa,", "--dataset", "PopQA=data/p", "--split", "dev", "--limit", "6", "--retriever",
                     "bm25:idx", "--max-turns", "2", "--max-observation-tokens", "50", "--max-total-tokens", "900",
                     "--steps", "7", "--batch-size", "2", "--lr", "3e-6", "--dtype", "bfloat16",
                     "--autocast-dtype", "auto", "--seed", "5", "--import", "my_pkg.teachers")
    assert code == 0
    assert trained.only[0][0] == SFTConfig(
        model="resolved/tiny", output_dir="o", benchmarks=["NQ", "popqa"], datasets={"popqa": "data/p"},
        split="dev", limit=6, teacher="oracle", retriever="bm25:idx", max_turns=2, max_observation_tokens=50,
        max_total_tokens=900, steps=7, batch_size=2, lr=3e-6, dtype="bfloat16", autocast_dtype="auto", seed=5)
    assert loaded.only == ((["my_pkg.teachers"],), {})
    run(capsys, "sft", "--model", "tiny", "--output-dir", "o", "--autocast-dtype", "bfloat16")
    assert trained.calls[-1][0][0].autocast_dtype == "bfloat16"


def test_sft_refusals(monkeypatch, capsys):
    trained, _ = _sft(monkeypatch)
    code, _, err = run(capsys, "sft", "--model", "smolm2", "--output-dir", "o")
    assert code == 1 and "did you mean smollm2?" in err
    code, _, err = run(capsys, "sft", "--model", "tiny", "--output-dir", "o", "--retriever", "bm52:idx")
    assert code == 1 and "did you mean bm25?" in err
    code, _, err = run(capsys, "sft", "--model", "tiny", "--output-dir", "o", "--dataset", "nq")
    assert code == 1 and err == "stppo sft: error: expected BENCH=PATH, got 'nq'\n"
    assert trained.calls == []
    base = ["sft", "--model", "tiny", "--output-dir", "o"]
    for flag in ("--limit", "--max-turns", "--max-observation-tokens", "--max-total-tokens", "--steps",
                 "--batch-size"):
        assert "must be >= 1" in usage_error(capsys, *base, flag, "0"), flag
    assert "invalid choice" in usage_error(capsys, *base, "--autocast-dtype", "float16")
    assert "invalid float" in usage_error(capsys, *base, "--lr", "x")
    assert "invalid int" in usage_error(capsys, *base, "--seed", "x")
    assert "--model" in usage_error(capsys, "sft", "--output-dir", "o")
    assert "--output-dir" in usage_error(capsys, "sft", "--model", "tiny")


# ---------------------------------------------------------------- train


class FakeTrainer:
    made: list = []

    def __init__(self, config, resume=False, overwrite=False):
        FakeTrainer.made.append((config, resume, overwrite))

    def train(self):
        return {"iteration": 1, "reward": 0.25, "ok": True, "algo": "grpo", "per_turn": [1, 2]}


def _train(monkeypatch):
    from stppo_agent.models import default_model
    from stppo_agent.runs import run_summary
    from stppo_agent.training import trainer

    FakeTrainer.made = []
    monkeypatch.setattr(trainer, "Trainer", FakeTrainer)
    monkeypatch.setattr(default_model, "resolve_model", Calls(lambda name: f"resolved/{name}"))
    monkeypatch.setattr(run_summary, "run_summary", Calls(lambda run_dir, title: f"SUMMARY {run_dir} | {title}"))
    return FakeTrainer.made, run_summary.run_summary


def test_train_flags_and_sets_reach_the_trainer(monkeypatch, capsys, tmp_path):
    made, summary = _train(monkeypatch)
    plugin = plugin_file(tmp_path)
    code, out, err = run(capsys, "train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", "tiny",
                         "--output-dir", str(tmp_path / "run"), "--iterations", "2", "--set", "optimizer.actor_lr=3e-6",
                         "--set", "algorithm.clip_high=0.3", "--import", str(plugin), "--import", str(plugin))
    assert (code, err) == (0, "")
    (config, resume, overwrite), = made
    assert (resume, overwrite) == (False, False)
    assert (config.algo, config.env, config.model, config.output_dir, config.iterations, config.optimizer.actor_lr) == \
        ("grpo", "stppo/Toy-v0", "resolved/tiny", str(tmp_path / "run"), 2, 3e-6)
    assert config.algorithm["clip_high"] == 0.3 and config.plugins == [str(plugin)]  # absolute, once
    assert out == f"SUMMARY {tmp_path / 'run'} | trained\n" and len(summary.calls) == 1
    run(capsys, "train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", "tiny", "--output-dir",
        str(tmp_path / "run"), "--overwrite")
    assert made[-1][1:] == (False, True) and made[-1][0].iterations == 100


def test_train_imports_join_the_configs_plugins_after_them(monkeypatch, capsys, tmp_path):
    from stppo_agent.training.config import TrainConfig

    made, _ = _train(monkeypatch)
    first, second = plugin_file(tmp_path), plugin_file(tmp_path, "_b")
    config = tmp_path / "config.yaml"
    config.write_text(TrainConfig(algo="grpo", env="stppo/Toy-v0", model="tiny", plugins=[str(first)]).to_yaml())
    assert run(capsys, "train", "--config", str(config), "--output-dir", str(tmp_path / "run"),
               "--import", str(second))[0] == 0
    assert made[-1][0].plugins == [str(first), str(second)]


def test_train_json_prints_the_numbers_only(monkeypatch, capsys, tmp_path):
    made, summary = _train(monkeypatch)
    code, out, _ = run(capsys, "train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", "tiny",
                       "--output-dir", str(tmp_path / "run"), "--json")
    assert code == 0 and summary.calls == []
    assert out == json.dumps({"iteration": 1, "reward": 0.25, "ok": True}, indent=1) + "\n"


def test_train_resume_reads_the_runs_own_config_unless_one_is_given(monkeypatch, capsys, tmp_path):
    from stppo_agent.training.config import TrainConfig

    made, _ = _train(monkeypatch)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text(TrainConfig(algo="grpo", env="stppo/Toy-v0", model="tiny",
                                                    output_dir=str(folder),
                                                    optimizer=OptimizerConfig(actor_lr=5e-6)).to_yaml())
    other = tmp_path / "other.yaml"
    other.write_text(TrainConfig(algo="ppo", env="stppo/Toy-v0", model="tiny",
                                 optimizer=OptimizerConfig(actor_lr=7e-6)).to_yaml())
    assert run(capsys, "train", "--resume", "--output-dir", str(folder))[0] == 0
    config, resume, overwrite = made[-1]
    assert (config.algo, config.optimizer.actor_lr, config.model, resume, overwrite) == ("grpo", 5e-6,
                                                                                         "resolved/tiny", True,
                                                                               False)
    run(capsys, "train", "--resume", "--output-dir", str(folder), "--config", str(other))
    assert (made[-1][0].algo, made[-1][0].optimizer.actor_lr) == ("ppo", 7e-6)
    run(capsys, "train", "--output-dir", str(folder), "--env", "stppo/Toy-v0", "--model", "tiny")
    assert (made[-1][0].algo, made[-1][0].optimizer.actor_lr, made[-1][1]) == ("st_ppo", 1e-6,
                                                                               False)  # no --resume: defaults
    run(capsys, "train", "--resume", "--output-dir", str(tmp_path / "new"), "--env", "stppo/Toy-v0", "--model", "m/x")
    assert (made[-1][0].algo, made[-1][0].model, made[-1][1]) == ("st_ppo", "resolved/m/x", True)


def test_train_checks_run_before_the_trainer(monkeypatch, capsys, tmp_path):
    made, _ = _train(monkeypatch)
    base = ["train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", "tiny", "--output-dir", str(tmp_path)]
    code, _, err = run(capsys, *base, "--set", "checkpoint.optimizer=newest", "--set", "monitor.on_collapse=rollback")
    assert code == 1 and "checkpoint.optimizer=newest drops the optimizer state" in err
    code, _, err = run(capsys, *base, "--set", "checkpoint.dtype=int3")
    assert code == 1 and "checkpoint.dtype must be" in err
    code, _, err = run(capsys, *base[:2], "st_ppp", *base[3:])
    assert code == 1 and "did you mean st_ppo?" in err
    assert made == []
    assert "must be >= 1" in usage_error(capsys, *base, "--iterations", "0")


def test_train_no_model_stays_unresolved_and_only_the_main_process_prints(monkeypatch, capsys, tmp_path):
    from stppo_agent.distributed import process_group
    from stppo_agent.models import default_model

    made, summary = _train(monkeypatch)
    monkeypatch.setattr(process_group, "is_main", lambda: False)
    assert run(capsys, "train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--output-dir", str(tmp_path)) == \
        (0, "", "")
    assert made[-1][0].model == "" and default_model.resolve_model.calls == [] and summary.calls == []
