"""`stppo plot` labels every run uniquely, as `stppo compare` labels results: runs/a/train and runs/b/train (the
demo's layout) are two curves, "a/train" and "b/train" (issue 33.8)."""

from __future__ import annotations

import json

import matplotlib.axes
import pytest

from stppo_agent.cli import main
from stppo_agent.runs.plots import plot_runs


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
