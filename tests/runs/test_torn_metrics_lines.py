"""A torn last line in metrics.jsonl (kill -9 mid-write, or a run still writing it) is left out by every reader --
``stppo plot``, ``hf:RUN@latest`` / ``@best`` -- as ``--resume`` already drops it; a corrupt line before the last
is named, with its file and line, by the readers that need the records."""

from __future__ import annotations

from pathlib import Path

import pytest

from stppo_agent.models.tiny import build_tiny_llama, toy_train_command, word_tokenizer
from tests.support.cli_in_process import stppo


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    from stppo_agent.cli import main

    root = tmp_path_factory.mktemp("torn")
    model = build_tiny_llama(root / "model", word_tokenizer())
    out = root / "run"
    assert main(toy_train_command(model, out, 3, extra=("monitor.on_collapse=none",))[3:]) == 0
    return out


def evaluate(agent: str, out: Path, capsys):
    return stppo("eval", "--agent", agent, "--benchmarks", "nq", "--limit", "1", "--max-turns", "1",
                 "--max-new-tokens", "2", "--output-dir", str(out), capsys=capsys)


@pytest.fixture
def torn(run):
    metrics = run / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"step": 4, "reward": 0.')  # what kill -9 during a write leaves
    yield metrics
    metrics.write_text(whole)


def test_plot_leaves_out_a_torn_last_line(run, torn, tmp_path, capsys):
    done = stppo("plot", str(run), "--out", str(tmp_path / "plots"), capsys=capsys)
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "plots").glob("*.png"))


@pytest.mark.parametrize("which, chosen", [("latest", "step-3: the newest checkpoint"),
                                           ("best", "the checkpoint with the highest training reward")])
def test_a_checkpoint_is_picked_past_a_torn_last_line(run, torn, tmp_path, capsys, which, chosen):
    done = evaluate(f"hf:{run}@{which}", tmp_path / "eval", capsys)
    assert done.returncode == 0, done.stderr
    assert chosen in done.stdout


def test_a_corrupt_line_before_the_last_is_named_and_latest_does_not_read_the_metrics(run, tmp_path, capsys):
    metrics = run / "metrics.jsonl"
    whole = metrics.read_text()
    lines = whole.splitlines()
    metrics.write_text("\n".join([lines[0], "not json", *lines[1:]]) + "\n")
    try:
        refused = evaluate(f"hf:{run}@best", tmp_path / "best", capsys)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert f"{metrics}, line 2 is not JSON" in refused.stderr and "fix or remove that line" in refused.stderr
        plotted = stppo("plot", str(run), "--out", str(tmp_path / "plots"), capsys=capsys)
        assert plotted.returncode == 1 and f"{metrics}, line 2 is not JSON" in plotted.stderr
        done = evaluate(f"hf:{run}@latest", tmp_path / "latest", capsys)  # needs no metrics at all
        assert done.returncode == 0 and "step-3: the newest checkpoint" in done.stdout, done.stderr
    finally:
        metrics.write_text(whole)
