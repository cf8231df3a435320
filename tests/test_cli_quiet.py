"""Without --verbose no third-party logs or progress bars (Lucene, transformers, datasets); with it, they show
(issue 31.5). `--help` says so."""

from __future__ import annotations

import json

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
