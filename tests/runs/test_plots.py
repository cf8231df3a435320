"""``stppo_agent.runs.plots``: the plotted series, labels, styles per run and collapse
events (the data, not pixels)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


# -- plots ---------------------------------------------------------------------------------------------------------
def write_records(folder: Path, name: str, records: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def captured_figures(monkeypatch):
    """The figures plot_runs draws, kept open for inspection; savefig only records where and at what dpi."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    figures, saved = [], []

    def savefig(figure, path, **kwargs):
        saved.append((Path(path).name, kwargs))
        Path(path).write_bytes(b"png")

    monkeypatch.setattr(Figure, "savefig", savefig)
    monkeypatch.setattr(Figure, "tight_layout", lambda figure: None)
    monkeypatch.setattr(plt, "close", figures.append)
    yield figures, saved
    monkeypatch.undo()
    for figure in figures:
        plt.close(figure)


def series(axis):
    return [(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in axis.get_lines()
            if not line.get_label().startswith(("collapse", "_child"))]


def test_plots_collapse_events_in_order():
    from stppo_agent.runs.plots import collapse_events

    records = [{"step": 1}, {"step": 2, "collapse/alarm": True}, {"step": 3, "collapse/alarm": True,
                                                                     "collapse/rollback_to": 1},
               {"step": 4, "collapse/alarm": 0}, {"step": "5", "collapse/rollback_to": 2}]
    assert collapse_events(records) == [(2, "alarm"), (3, "rollback"), (5, "rollback")]
    assert collapse_events([]) == []


def test_plots_run_labels_resolve_folders_and_refuse_one_twice(tmp_path, monkeypatch):
    from stppo_agent.runs.plots import run_labels

    monkeypatch.chdir(tmp_path)
    for name in ("a/train", "b/train", "c"):
        (tmp_path / name).mkdir(parents=True)
    assert run_labels(["a/train", "b/train/"]) == ["a/train", "b/train"]
    monkeypatch.chdir(tmp_path / "c")
    assert run_labels(["."]) == ["c"]
    with pytest.raises(ValueError) as caught:
        run_labels([".", "../c/", "../a/train"])
    assert str(caught.value) == "run ../c/ is given twice (as . too)"


def test_plots_draw_every_runs_series_per_metric_with_events_and_legends(tmp_path, captured_figures):
    from stppo_agent.runs.plots import PLOTS, plot_runs

    figures, saved = captured_figures
    assert PLOTS == {"reward": ["reward"], "clipping": ["clip_frac", "turn_clip_frac"],
                     "clip_bias": ["clip_bias_norm", "pg_grad_norm", "clip_bias_scale"],
                     "kl": ["approx_kl", "kl_to_reference", "kl_loss"], "entropy": ["entropy"],
                     "response_length": ["response_tokens", "turns"]}
    write_records(tmp_path / "x" / "a", "metrics.jsonl", [
        {"step": 1, "reward": 0.1, "clip_frac": 0.2, "entropy": "nan"}, {"step": 2, "reward": 0.3, "turns": 2},
        {"step": 3, "reward": 0.2, "collapse/alarm": True}])
    write_records(tmp_path / "y" / "a", "metrics.jsonl", [
        {"step": 1, "reward": 0.5, "clip_frac": 0.4}, {"step": 2, "reward": 0.6, "collapse/rollback_to": 1}])
    out = tmp_path / "plots" / "deep"
    written = plot_runs([tmp_path / "x" / "a", tmp_path / "y" / "a"], out)
    names = ["reward", "clipping", "clip_bias", "kl", "entropy", "response_length"]
    assert written == [out / f"{name}.png" for name in names]
    assert saved == [(f"{name}.png", {"dpi": 100}) for name in names] and all(p.exists() for p in written)
    assert len(figures) == 6
    sizes = [tuple(f.get_size_inches()) for f in figures]
    assert sizes == [(5.0, 3.5), (10.0, 3.5), (15.0, 3.5), (15.0, 3.5), (5.0, 3.5), (10.0, 3.5)]
    reward = figures[0].axes[0]
    assert reward.get_title() == "reward" and reward.get_xlabel() == "iteration"
    assert series(reward) == [("x/a", [1, 2, 3], [0.1, 0.3, 0.2]), ("y/a", [1, 2], [0.5, 0.6])]
    first, second = reward.get_lines()[:2]
    from matplotlib.colors import to_hex

    assert (to_hex(first.get_color()), first.get_linestyle(), first.get_marker()) == ("#1f77b4", "-", "o")
    assert (to_hex(second.get_color()), second.get_linestyle(), second.get_marker()) == ("#ff7f0e", "--", "s")
    assert first.get_markersize() == 4 and first.get_alpha() == 0.85
    events = [(line.get_label(), list(line.get_xdata()), line.get_color(), line.get_linestyle(), line.get_linewidth())
              for line in reward.get_lines()[2:]]
    assert events == [("collapse alarm", [3, 3], "tab:red", ":", 1.2),
                      ("collapse rollback", [2, 2], "tab:purple", "--", 1.5)]
    assert [t.get_text() for t in reward.get_legend().get_texts()] == ["x/a", "y/a", "collapse alarm",
                                                                       "collapse rollback"]
    assert reward.xaxis.get_major_locator()._integer
    clipping = figures[1].axes
    assert [a.get_title() for a in clipping] == ["clip_frac", "turn_clip_frac"]
    assert series(clipping[0]) == [("x/a", [1], [0.2]), ("y/a", [1], [0.4])]
    assert series(clipping[1]) == [] and clipping[1].get_legend() is None  # nothing drawn: no legend
    assert len(clipping[1].get_lines()) == 2  # the events are still marked
    assert series(figures[4].axes[0]) == []  # "nan" as a string is not a point
    assert series(figures[5].axes[1]) == [("x/a", [2], [2])]
    assert not (out / "steps.png").exists()


def test_plots_a_single_run_has_a_legend_only_for_its_events(tmp_path, captured_figures):
    from stppo_agent.runs.plots import plot_runs

    figures, _ = captured_figures
    write_records(tmp_path / "calm", "metrics.jsonl", [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2}])
    plot_runs([tmp_path / "calm"], tmp_path / "out")
    assert figures[0].axes[0].get_legend() is None
    assert series(figures[0].axes[0]) == [("calm", [1, 2], [0.1, 0.2])]
    write_records(tmp_path / "wild", "metrics.jsonl", [{"step": 1, "reward": 0.1, "collapse/alarm": True}])
    plot_runs([tmp_path / "wild"], tmp_path / "out2")
    assert [t.get_text() for t in figures[6].axes[0].get_legend().get_texts()] == ["wild", "collapse alarm"]
    with pytest.raises(FileNotFoundError) as caught:
        plot_runs([tmp_path / "none1", tmp_path / "none2"], tmp_path / "out3")
    assert str(caught.value) == f"no metrics.jsonl in {tmp_path / 'none1'}, {tmp_path / 'none2'}"


def test_plots_step_diagnostics_per_optimizer_step(tmp_path, captured_figures):
    from stppo_agent.runs.plots import STEP_PLOT_KEYS, STEP_PLOT_LOG_KEYS, plot_runs

    figures, saved = captured_figures
    assert STEP_PLOT_KEYS == ["ratio_max", "ratio_p99", "token_outside_frac", "turn_outside_frac", "clip_bias_norm",
                              "grad_cos_to_first"]
    assert STEP_PLOT_LOG_KEYS == {"ratio_max": 1.0, "clip_bias_norm": 0.1}
    write_records(tmp_path / "a", "metrics.jsonl", [{"step": 1, "reward": 0.1}])
    write_records(tmp_path / "a", "steps.jsonl", [
        {"step": 1, "minibatch": 0, "on_policy": True, "ratio_max": 1.0, "grad_cos_to_first": 1.0},
        {"step": 2, "minibatch": 1, "on_policy": False, "ratio_max": 3.0, "grad_cos_to_first": 0.5},
        {"step": 3, "minibatch": 0, "on_policy": True, "ratio_max": 1.5}, {"step": 4, "ratio_max": "inf"},
        {"step": 5, "minibatch": 0, "on_policy": False, "ratio_max": 2.0}])  # a lagged iteration's first step
    write_records(tmp_path / "b", "steps.jsonl", [{"step": 2, "minibatch": 0, "on_policy": True, "ratio_max": 1.1}])
    written = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert written[-1] == tmp_path / "out" / "steps.png" and len(written) == 7
    assert saved[-1] == ("steps.png", {"dpi": 100})
    steps = figures[-1]
    assert tuple(steps.get_size_inches()) == pytest.approx((15.0, 6.6))
    axes = steps.axes
    assert [a.get_title() for a in axes] == STEP_PLOT_KEYS
    assert all(a.get_xlabel() == "optimizer step" for a in axes)
    ratio = axes[0]
    assert series(ratio) == [("a", [1, 2, 3, 5], [1.0, 3.0, 1.5, 2.0]), ("b", [2], [1.1])]
    assert ratio.get_lines()[0].get_markersize() == 3 and ratio.get_lines()[1].get_linestyle() == "--"
    starts = [line for line in ratio.get_lines() if line.get_label().startswith("_child")]
    assert [(list(line.get_xdata()), line.get_color(), line.get_linestyle(), line.get_linewidth())
            for line in starts] == [([1.5, 1.5], "grey", ":", 0.8), ([2.5, 2.5], "grey", ":", 0.8),
                                    ([4.5, 4.5], "grey", ":", 0.8)]
    assert ratio.get_yscale() == "symlog" and ratio.yaxis.get_transform().linthresh == 1.0
    assert ratio.get_ylim()[0] == 0
    assert axes[4].get_yscale() == "symlog" and axes[4].yaxis.get_transform().linthresh == 0.1
    assert axes[1].get_yscale() == "linear" and axes[5].get_yscale() == "linear"
    assert series(axes[5]) == [("a", [1, 2], [1.0, 0.5])]
    assert [t.get_text() for t in ratio.get_legend().get_texts()] == ["a", "b"]
    from matplotlib.font_manager import FontProperties

    assert ratio.get_legend().get_texts()[0].get_fontsize() == FontProperties(size="small").get_size_in_points()
    assert axes[1].get_legend() is None and axes[5].get_legend() is not None
    assert axes[0].xaxis.get_major_locator()._integer
    plot_runs([tmp_path / "a"], tmp_path / "one")
    assert figures[-1].axes[0].get_legend() is None  # one run: no legend


def test_plots_keep_each_runs_style_in_every_panel_and_label_events_once(tmp_path, captured_figures):
    from matplotlib.colors import to_hex
    from matplotlib.font_manager import FontProperties

    from stppo_agent.runs.plots import plot_runs

    figures, _ = captured_figures
    runs = []
    for i in range(7):
        records = [{"step": 1, "reward": float(i)}, {"step": 2, "reward": float(i) + 1}]
        if i == 0:
            records = [{"step": 1, "reward": 0.0, "collapse/alarm": True}, {"step": 2, "reward": 1.0},
                       {"step": 3, "collapse/alarm": True}, {"step": 4, "collapse/rollback_to": 1},
                       {"step": 5, "collapse/rollback_to": 2}]
        if i >= 1:
            records[0]["entropy"] = 0.5  # run 0 has no entropy: the others keep their own colours
        write_records(tmp_path / f"r{i}", "metrics.jsonl", records)
        runs.append(tmp_path / f"r{i}")
    out = tmp_path / "out"
    out.mkdir()
    plot_runs(runs, out)  # an existing folder is fine
    plot_runs(runs[1:3], out)  # and so is drawing over it
    reward = figures[0].axes[0]
    drawn = [(line.get_label(), to_hex(line.get_color()), line.get_linestyle(), line.get_marker())
             for line in reward.get_lines()[:7]]
    assert drawn == [("r0", "#1f77b4", "-", "o"), ("r1", "#ff7f0e", "--", "s"), ("r2", "#2ca02c", ":", "^"),
                     ("r3", "#d62728", "-.", "D"), ("r4", "#9467bd", "-", "v"), ("r5", "#8c564b", "--", "x"),
                     ("r6", "#e377c2", ":", "o")]
    entropy = figures[4].axes[0]
    assert [(line.get_label(), to_hex(line.get_color())) for line in entropy.get_lines()[:2]] == [
        ("r1", "#ff7f0e"), ("r2", "#2ca02c")]
    legend = [t.get_text() for t in reward.get_legend().get_texts()]
    assert legend == ["r0", "r1", "r2", "r3", "r4", "r5", "r6", "collapse alarm", "collapse rollback"]
    assert reward.get_legend().get_texts()[0].get_fontsize() == FontProperties(size="small").get_size_in_points()
    assert len(reward.get_lines()) == 7 + 4  # two alarms, two rollbacks
    pair = figures[6].axes[0]  # two runs without events: a legend to tell them apart
    assert [t.get_text() for t in pair.get_legend().get_texts()] == ["r1", "r2"]
