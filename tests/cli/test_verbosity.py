"""How much the third-party libraries print (stppo_agent/cli/verbosity.py): their errors
only unless ``--verbose`` or ``STPPO_VERBOSE=1``; no Lucene, transformers or datasets logs or bars without it."""

from __future__ import annotations

import json
import os

import pytest

from stppo_agent.cli import main

ROWS = [{"id": f"q{i}", "question": f"question {i}?", "golden_answers": ["a"]} for i in range(3)]


def _eval(tmp_path, name: str, verbose: bool) -> list[str]:
    data = tmp_path / f"{name}.jsonl"  # a file datasets has never seen: it builds (and shows a bar) afresh
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return ["--verbose"] * verbose + ["eval", "--agent", "oracle", "--benchmarks", "nq", "--dataset", f"nq={data}",
                                      "--retriever", "http://127.0.0.1:9", "--output-dir", str(tmp_path / name)]


def test_eval_shows_datasets_progress_bars_only_with_verbose(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("STPPO_VERBOSE", "0")  # restored afterwards, whatever --verbose exports
    assert main(_eval(tmp_path, "quiet", verbose=False)) == 0
    out, err = capfd.readouterr()
    assert "examples/s" not in err + out and "Generating" not in err + out, err
    assert "EM/acc" in out  # the project's own output stays
    assert main(_eval(tmp_path, "loud", verbose=True)) == 0
    assert "Generating train split" in capfd.readouterr().err
    monkeypatch.setenv("STPPO_VERBOSE", "0")  # what --verbose exported for its child processes
    assert main(_eval(tmp_path, "quiet_again", verbose=False)) == 0  # --verbose does not outlive its command
    assert "examples/s" not in capfd.readouterr().err


def test_the_third_party_loggers_follow_verbose(monkeypatch):
    monkeypatch.setenv("STPPO_VERBOSE", "0")
    import datasets
    import transformers

    from stppo_agent.cli.verbosity import set_third_party_output

    set_third_party_output(verbose=False)
    assert transformers.logging.get_verbosity() == transformers.logging.ERROR
    assert datasets.logging.get_verbosity() == datasets.logging.ERROR
    assert not datasets.utils.is_progress_bar_enabled()
    set_third_party_output(verbose=True)
    assert transformers.logging.get_verbosity() == transformers.logging.WARNING
    assert datasets.utils.is_progress_bar_enabled()
    set_third_party_output(verbose=False)


@pytest.mark.parametrize("verbose", [False, True])
def test_index_bm25_passes_anserini_quiet_unless_verbose(tmp_path, monkeypatch, verbose, capsys):
    import stppo_envs.retrieval.indexing as indexing

    monkeypatch.setenv("STPPO_VERBOSE", "0")
    seen = {}

    def fake_build(corpus, out, *, threads=1, quiet=True):
        seen["quiet"] = quiet
        return out

    monkeypatch.setattr(indexing, "build_bm25_from_corpus", fake_build)
    argv = ["--verbose"] * verbose + ["index", "bm25", "--corpus", "c.jsonl", "--out", str(tmp_path / "i")]
    assert main(argv) == 0
    assert seen["quiet"] is (not verbose)  # Anserini's 40 INFO lines only when asked for


def test_help_tells_what_verbose_does(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "third-party logs and progress bars (Lucene, Anserini, transformers, datasets)" in text
    assert "without it only their errors" in text


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
