"""`stppo plot` refuses a run it cannot plot (a mistyped folder, a folder without metrics.jsonl, a file) before
drawing anything, instead of plotting the other runs alone and exiting 0."""

from __future__ import annotations

import json

import pytest

from .cli_in_process import stppo


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("tour", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward": 0.1 * i}) + "\n"
                                                               for i in (1, 2)))
    (tmp_path / "evaluation").mkdir()
    (tmp_path / "evaluation" / "results.json").write_text("[]\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("a file\n")
    return tmp_path


@pytest.mark.parametrize("named, message", [
    ("tuor", "stppo plot: error: tuor does not exist; . holds: empty, evaluation, notes.txt, other, tour "
             "(did you mean tour?)\n"),
    ("evaluation", "stppo plot: error: evaluation holds no metrics.jsonl, so no curves (it holds: results.json); a "
                   "training run writes it as its iterations end\n"),
    ("empty", "stppo plot: error: empty holds no metrics.jsonl, so no curves (it is empty); a training run writes it "
              "as its iterations end\n"),
    ("notes.txt", "stppo plot: error: notes.txt is a file, not a run folder\n"),
])
def test_a_run_that_cannot_be_plotted_is_refused_before_any_plot(runs, capsys, named, message):
    done = stppo("plot", "tour", named, "--out", "plots", capsys=capsys)
    assert (done.returncode, done.stdout, done.stderr) == (1, "", message)
    assert not (runs / "plots").exists()


def test_every_run_named_is_plotted(runs, capsys):
    done = stppo("plot", "tour", "other", "--out", "plots", capsys=capsys)
    assert done.returncode == 0, done.stderr
    assert "plots/reward.png" in done.stdout.splitlines() and (runs / "plots" / "reward.png").stat().st_size > 0
