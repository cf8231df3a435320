"""``stppo plot`` (stppo_agent/cli/plot.py): what it hands the plotter, a unique label per
run, and a run it cannot plot refused before anything is drawn."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.axes
import pytest

from stppo_agent.cli import main
from stppo_agent.runs.plots import plot_runs
from tests.support.cli_calls import Calls, run, usage_error
from tests.support.cli_in_process import stppo


def _run(folder, rewards, steps=False):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward": r}) + "\n"
                                                  for i, r in enumerate(rewards)))
    if steps:
        (folder / "steps.jsonl").write_text("".join(json.dumps({"step": i + 1, "iteration": 1, "on_policy": i == 0,
                                                                "ratio_max": 1 + r}) + "\n"
                                                    for i, r in enumerate(rewards)))
    return folder


@pytest.fixture
def drawn(monkeypatch):
    """(panel title, label, y values) of every curve drawn."""
    curves = []
    plot = matplotlib.axes.Axes.plot

    def recording_plot(self, *args, **kwargs):
        lines = plot(self, *args, **kwargs)
        curves.append((self, kwargs.get("label"), list(args[1]) if len(args) > 1 else None))
        return lines

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording_plot)
    return lambda title: [(label, ys) for axis, label, ys in curves if axis.get_title() == title]


def test_runs_whose_folders_share_a_name_are_two_labelled_curves(tmp_path, drawn):
    a = _run(tmp_path / "runs" / "a" / "train", [0.1, 0.2], steps=True)
    b = _run(tmp_path / "runs" / "b" / "train", [0.5, 0.6], steps=True)
    plot_runs([a, b], tmp_path / "plots")
    assert drawn("reward") == [("a/train", [0.1, 0.2]), ("b/train", [0.5, 0.6])]
    assert [label for label, _ in drawn("ratio_max")] == ["a/train", "b/train"]


def test_distinct_names_stay_short_and_a_lone_run_keeps_its_name(tmp_path, drawn):
    runs = [_run(tmp_path / "x" / "ppo", [0.1]), _run(tmp_path / "y" / "st_ppo", [0.2])]
    plot_runs(runs, tmp_path / "plots")
    assert [label for label, _ in drawn("reward")] == ["ppo", "st_ppo"]


def test_the_current_folder_and_a_trailing_slash_name_the_run(tmp_path, drawn, monkeypatch):
    run = _run(tmp_path / "runs" / "demo" / "train", [0.3])
    monkeypatch.chdir(run)
    plot_runs(["."], tmp_path / "plots")
    plot_runs([f"{run}/"], tmp_path / "plots2")
    assert [label for label, _ in drawn("reward")] == ["train", "train"]


def test_the_same_run_twice_is_refused(tmp_path, capsys):
    run = _run(tmp_path / "runs" / "a" / "train", [0.3])
    with pytest.raises(ValueError, match="given twice"):
        plot_runs([run, tmp_path / "runs" / "a" / ".." / "a" / "train"], tmp_path / "plots")
    assert main(["plot", str(run), str(run), "--out", str(tmp_path / "plots")]) == 1
    assert "given twice" in capsys.readouterr().err


# `stppo plot` refuses a run it cannot plot (a mistyped folder, a folder without metrics.jsonl, a file) before drawing
# anything, instead of plotting the other runs alone and exiting 0.


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


def test_plot_hands_the_runs_and_the_folder_and_prints_each_file(monkeypatch, capsys, run_folders):
    from stppo_agent.runs import plots

    monkeypatch.setattr(plots, "plot_runs", Calls([Path("o/loss.png"), Path("o/reward.png")]))
    assert run(capsys, "plot", "r1", "r2", "--out", "o") == (0, "o/loss.png\no/reward.png\n", "")
    assert plots.plot_runs.only == ((["r1", "r2"], "o"), {})
    assert "--out" in usage_error(capsys, "plot", "r1")
    assert "required: runs" in usage_error(capsys, "plot", "--out", "o")
