"""Pins for what a run leaves for a researcher to read later (issue 27), second part: the plotted series (data,
axis labels, styles per run, collapse events; not pixels) and the recorded rollouts (tensors, metadata, transcripts,
every rank's share). The first part is tests/test_pins_run_records.py. No model, no subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


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


# -- recording -----------------------------------------------------------------------------------------------------
def tokenizer():
    from stppo_agent.models.tiny import word_tokenizer

    return word_tokenizer()  # <pad>=0 <eos>=1 <unk>=2 say=3 ok=4 red=5 green=6 blue=7 gold=8


def multi_turn_batch(rows=(0, 1, 2), info=True):
    """Three trajectories: P = 3 (left-padded), T = 5. Row 0: policy turn 0, an observation, policy turn 1; row 1:
    two policy turns back to back; row 2: an observation first."""
    from stppo_agent.rollouts.batch import RolloutBatch

    prompt_ids = [[0, 3, 4], [3, 3, 4], [0, 0, 4]]
    prompt_mask = [[0, 1, 1], [1, 1, 1], [0, 0, 1]]
    response = [[5, 6, 7, 8, 0], [5, 6, 7, 0, 0], [8, 5, 0, 0, 0]]
    response_mask = [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    policy = [[1, 1, 0, 1, 0], [1, 1, 1, 0, 0], [0, 1, 0, 0, 0]]
    turns = [[0, 0, -1, 1, -1], [0, 1, 1, -1, -1], [-1, 2, -1, -1, -1]]
    infos = [{"example_id": f"e{r}", "benchmark": "nq", "question": f"¿q{r}?", "finish_reason": "answer",
              "extra": r} for r in range(3)]
    pick = list(rows)
    return RolloutBatch(
        input_ids=torch.tensor([prompt_ids[r] + response[r] for r in pick]),
        attention_mask=torch.tensor([prompt_mask[r] + response_mask[r] for r in pick]), prompt_width=3,
        response_ids=torch.tensor([response[r] for r in pick]),
        loss_mask=torch.tensor([policy[r] for r in pick], dtype=torch.bool),
        turn_ids=torch.tensor([turns[r] for r in pick]),
        sample_logprobs=torch.tensor([[-0.5 * r - 0.1 * t for t in range(5)] for r in pick]),
        rewards=torch.tensor([1.0, 0.0, 0.5])[pick], group_ids=torch.tensor([0, 0, 1])[pick],
        terminated=torch.tensor([True, False, True])[pick], truncated=torch.tensor([False, True, False])[pick],
        stats={"turns": 2.0, "reward": 0.5}, episode_info=[infos[r] for r in pick] if info else None)


TRANSCRIPTS = [
    {"benchmark": "nq", "example_id": "e0", "extra": 0, "finish_reason": "answer", "group_id": 0, "question": "¿q0?",
     "reward": 1.0, "row": 0, "transcript": [["prompt", -1, "say ok"], ["policy", 0, "red green"],
                                             ["observation", -1, "blue"], ["policy", 1, "gold"]]},
    {"benchmark": "nq", "example_id": "e1", "extra": 1, "finish_reason": "answer", "group_id": 0, "question": "¿q1?",
     "reward": 0.0, "row": 1, "transcript": [["prompt", -1, "say say ok"], ["policy", 0, "red"],
                                             ["policy", 1, "green blue"]]},
    {"benchmark": "nq", "example_id": "e2", "extra": 2, "finish_reason": "answer", "group_id": 1, "question": "¿q2?",
     "reward": 0.5, "row": 2, "transcript": [["prompt", -1, "ok"], ["observation", -1, "gold"], ["policy", 2, "red"]]},
]


def test_recording_tokenizer_fingerprint_and_file_names(tmp_path):
    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.runs.recording import batch_file, tokenizer_fingerprint

    assert tokenizer_fingerprint(tokenizer()) == {
        "vocab_size": 9, "vocab_sha256": "dc91fd2e5b141273d5ed4603ec37c9863025089e39661b1a2a72e91443c648c5",
        "pad_token_id": 0, "eos_token_id": 1}
    assert tokenizer_fingerprint(word_tokenizer(["é", "a"]))["vocab_sha256"] == (
        "e7008b73e12d328c8abf6f5be7e5726f5fae90c405bba2054edf0a22ef5ea72e")  # the vocabulary as UTF-8, not \\u escapes
    assert batch_file(tmp_path, 7, 2, "jsonl") == tmp_path / "iter-000007.rank-2.jsonl"
    assert batch_file(tmp_path, 1234567, 0, "safetensors").name == "iter-1234567.rank-0.safetensors"


def test_recording_format_json_is_written_by_rank_zero_only(tmp_path):
    from stppo_agent.runs.recording import FORMAT_NAME, FORMAT_VERSION, RolloutRecorder, read_format

    assert (FORMAT_NAME, FORMAT_VERSION) == ("stppo-rollouts", 2)
    other = RolloutRecorder(tmp_path / "r1", tokenizer(), 1, 2)
    assert other.folder == tmp_path / "r1" / "rollouts" and other.folder.is_dir()
    assert list(other.folder.iterdir()) == []
    recorder = RolloutRecorder(tmp_path / "run", tokenizer(), 0, 2)
    assert (recorder.rank, recorder.world) == (0, 2)
    text = (tmp_path / "run" / "rollouts" / "format.json").read_text()
    assert text == json.dumps({"format": "stppo-rollouts", "version": 2, "tokenizer": {
        "vocab_size": 9, "vocab_sha256": "dc91fd2e5b141273d5ed4603ec37c9863025089e39661b1a2a72e91443c648c5",
        "pad_token_id": 0, "eos_token_id": 1}}, indent=1) + "\n"
    assert sorted(p.name for p in recorder.folder.iterdir()) == ["format.json"]
    assert read_format(recorder.folder)["version"] == 2


def test_recording_read_format_refuses_a_missing_or_foreign_format(tmp_path):
    from stppo_agent.runs.recording import read_format

    folder = tmp_path / "run" / "rollouts"
    folder.mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as caught:
        read_format(folder)
    assert str(caught.value) == (f"{tmp_path / 'run'} has no recorded rollouts ({folder / 'format.json'} is missing): "
                                 "train it with --set logging.save_rollouts=true to record them")
    for meta, shown in (({"format": "other", "version": 2}, "'other' v2"), ({"format": "stppo-rollouts", "version": 3},
                                                                             "'stppo-rollouts' v3"),
                        ({"version": 0}, "None v0"), ({"format": "stppo-rollouts"}, "'stppo-rollouts' vNone")):
        (folder / "format.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError) as caught:
            read_format(folder)
        assert str(caught.value) == (f"{folder / 'format.json'}: unsupported rollout format {shown} (this stppo reads "
                                     "stppo-rollouts v1, v2)")
    for version in (1, 2):
        (folder / "format.json").write_text(json.dumps({"format": "stppo-rollouts", "version": version, "x": 1}))
        assert read_format(folder) == {"format": "stppo-rollouts", "version": version, "x": 1}


def test_recording_record_writes_the_tensors_metadata_and_transcripts(tmp_path):
    from safetensors import safe_open

    from stppo_agent.runs.recording import TENSOR_FIELDS, RolloutRecorder, load_batch

    assert TENSOR_FIELDS == ("input_ids", "attention_mask", "response_ids", "loss_mask", "turn_ids",
                             "sample_logprobs", "rewards", "group_ids", "terminated", "truncated")
    batch = multi_turn_batch()
    recorder = RolloutRecorder(tmp_path, tokenizer(), 0, 1)
    recorder.record(2, batch)
    folder = tmp_path / "rollouts"
    assert sorted(p.name for p in folder.iterdir()) == ["format.json", "iter-000002.rank-0.jsonl",
                                                        "iter-000002.rank-0.safetensors"]
    with safe_open(str(folder / "iter-000002.rank-0.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"prompt_width": "3", "iteration": "2", "stats": '{"reward": 0.5, "turns": 2.0}',
                                     "rank": "0", "world_size": "1"}
        assert sorted(handle.keys()) == sorted(TENSOR_FIELDS)
        for name in TENSOR_FIELDS:
            assert torch.equal(handle.get_tensor(name), getattr(batch, name)), name
    lines = (folder / "iter-000002.rank-0.jsonl").read_text(encoding="utf-8")
    assert lines == "".join(json.dumps(t, ensure_ascii=False, sort_keys=True) + "\n" for t in TRANSCRIPTS)
    assert "¿q0?" in lines
    loaded = load_batch(folder, 2, 0)
    assert loaded.prompt_width == 3 and loaded.stats == {"reward": 0.5, "turns": 2.0}
    for name in TENSOR_FIELDS:
        assert torch.equal(getattr(loaded, name), getattr(batch, name)), name
    assert loaded.episode_info == [{"example_id": f"e{r}", "benchmark": "nq", "question": f"¿q{r}?",
                                    "finish_reason": "answer"} for r in range(3)]
    RolloutRecorder(tmp_path, tokenizer(), 1, 2).record(5, multi_turn_batch(info=False))
    plain = [json.loads(line) for line in (folder / "iter-000005.rank-1.jsonl").read_text().splitlines()]
    assert plain == [{k: v for k, v in t.items() if k in ("row", "group_id", "reward", "transcript")}
                     for t in TRANSCRIPTS]
    with safe_open(str(folder / "iter-000005.rank-1.safetensors"), framework="pt") as handle:
        assert (handle.metadata()["rank"], handle.metadata()["world_size"]) == ("1", "2")
    assert load_batch(folder, 5, 1).episode_info == [{}, {}, {}]  # no info: empty records, not None
    (folder / "iter-000005.rank-1.jsonl").unlink()
    assert load_batch(folder, 5, 1).episode_info is None
    from safetensors.torch import save_file

    save_file({name: getattr(batch, name) for name in TENSOR_FIELDS}, str(folder / "iter-000006.rank-0.safetensors"),
              metadata={"prompt_width": "3"})
    assert load_batch(folder, 6, 0).stats == {}  # written without statistics
    assert not list(folder.glob("*.tmp"))


def test_recording_rank_zero_removes_the_shares_of_ranks_this_run_lacks(tmp_path):
    from stppo_agent.runs.recording import RolloutRecorder

    folder = tmp_path / "rollouts"
    folder.mkdir()
    stale = ["iter-000003.rank-1.safetensors", "iter-000003.rank-1.jsonl", "iter-000003.rank-2.safetensors",
             "iter-000003.rank-3.jsonl", "iter-000004.rank-2.safetensors", "iter-000003.rank-x.jsonl",
             "iter-000003.rank-9"]
    for name in stale:
        (folder / name).write_text("old")
    RolloutRecorder(tmp_path, tokenizer(), 1, 2).record(3, multi_turn_batch([2]))  # rank 1 removes nothing
    assert all((folder / name).exists() for name in stale)
    RolloutRecorder(tmp_path, tokenizer(), 0, 2).record(3, multi_turn_batch([0, 1]))
    assert sorted(p.name for p in folder.glob("iter-*")) == sorted(
        ["iter-000003.rank-0.jsonl", "iter-000003.rank-0.safetensors", "iter-000003.rank-1.jsonl",
         "iter-000003.rank-1.safetensors", "iter-000004.rank-2.safetensors", "iter-000003.rank-x.jsonl",
         "iter-000003.rank-9"])
    assert (folder / "iter-000003.rank-1.jsonl").read_text() != "old"  # rank 1's own share, kept
    RolloutRecorder(tmp_path, tokenizer(), 0, 1).record(3, multi_turn_batch())
    assert sorted(p.name for p in folder.glob("iter-000003.*")) == [
        "iter-000003.rank-0.jsonl", "iter-000003.rank-0.safetensors", "iter-000003.rank-9", "iter-000003.rank-x.jsonl"]


def test_recording_world_size_of_an_iteration_and_missing_shares(tmp_path):
    from safetensors.torch import save_file

    from stppo_agent.runs.recording import (
        RolloutRecorder,
        check_iteration_files,
        recorded_iterations,
        recorded_world_size,
    )

    folder = tmp_path / "rollouts"
    for rank in (0, 1, 2):
        RolloutRecorder(tmp_path, tokenizer(), rank, 4).record(1, multi_turn_batch([rank]))
    assert recorded_world_size(folder, 1) == 4
    with pytest.raises(ValueError) as caught:
        check_iteration_files(folder, 1)
    assert str(caught.value) == (f"{folder}: iteration 1 was recorded by 4 processes, but the share of rank-3 is "
                                 "missing; a replay would use part of its data")
    (folder / "iter-000001.rank-1.safetensors").unlink()
    with pytest.raises(ValueError, match=r"but the share of rank-1, rank-3 is missing;"):
        check_iteration_files(folder, 1)
    with pytest.raises(FileNotFoundError) as caught:
        recorded_world_size(folder, 9)
    assert str(caught.value) == f"{folder / 'iter-000009.rank-0.safetensors'} is missing: iteration 9 was not recorded"
    with pytest.raises(FileNotFoundError, match="iteration 9 was not recorded"):
        check_iteration_files(folder, 9)
    # version 1: no world_size in the metadata; the world is the run of rank files from 0
    for rank in (0, 1, 3):
        save_file({"x": torch.zeros(1)}, str(folder / f"iter-000002.rank-{rank}.safetensors"),
                  metadata={"prompt_width": "1"})
    (folder / "iter-000002.rank-2.jsonl").write_text("")
    (folder / "iter-000002.rank-x.safetensors").write_text("")
    assert recorded_world_size(folder, 2) == 2 and check_iteration_files(folder, 2) == 2
    save_file({"x": torch.zeros(1)}, str(folder / "iter-000005.rank-0.safetensors"))  # no metadata at all
    assert recorded_world_size(folder, 5) == 1
    RolloutRecorder(tmp_path, tokenizer(), 0, 1).record(3, multi_turn_batch())
    assert check_iteration_files(folder, 3) == 1
    (folder / "iter-abc.rank-0.safetensors").write_text("")
    (folder / "iter-000007.rank-0.jsonl").write_text("")
    assert recorded_iterations(folder, 0) == [1, 2, 3, 5]
    assert recorded_iterations(folder, 1) == [2] and recorded_iterations(folder, 3) == [2]
    assert recorded_iterations(folder, 6) == []


def test_recording_load_iteration_merges_every_ranks_share_in_prompt_order(tmp_path):
    from stppo_agent.rollouts.batch import RolloutBatch
    from stppo_agent.runs.recording import RolloutRecorder, load_batch, load_iteration

    folder = tmp_path / "rollouts"
    RolloutRecorder(tmp_path, tokenizer(), 0, 1).record(1, multi_turn_batch())
    one = load_iteration(folder, 1, pad_id=0)
    assert one.group_ids.tolist() == [0, 0, 1] and one.stats == {"reward": 0.5, "turns": 2.0}
    assert one.episode_info[0]["example_id"] == "e0"

    whole = multi_turn_batch()
    first = whole.select([2])  # group 1
    first.stats = {"reward": 0.5, "turns": 1.0}
    second = whole.select([0, 1])  # group 0, with a narrower prompt
    second = RolloutBatch(**{**{f: getattr(second, f) for f in second.__dataclass_fields__},
                             "input_ids": second.input_ids[:, 1:], "attention_mask": second.attention_mask[:, 1:],
                             "prompt_width": 2, "stats": {"reward": 0.5, "turns": 4.0}})
    RolloutRecorder(tmp_path, tokenizer(), 0, 2).record(2, first)
    RolloutRecorder(tmp_path, tokenizer(), 1, 2).record(2, second)
    merged = load_iteration(folder, 2, pad_id=9)
    assert merged.group_ids.tolist() == [0, 0, 1] and merged.rewards.tolist() == [1.0, 0.0, 0.5]
    assert merged.prompt_width == 3
    assert merged.input_ids.tolist() == [[9, 3, 4, 5, 6, 7, 8, 0], [9, 3, 4, 5, 6, 7, 0, 0],
                                         [0, 0, 4, 8, 5, 0, 0, 0]]
    assert merged.stats == {"reward": pytest.approx(0.5), "turns": pytest.approx(3.0)}  # (1 * 1 + 4 * 2) / 3
    assert [info["example_id"] for info in merged.episode_info] == ["e0", "e1", "e2"]
    (folder / "iter-000002.rank-1.jsonl").unlink()
    assert load_iteration(folder, 2, pad_id=9).episode_info is None  # kept only where every share has it
    assert load_batch(folder, 2, 0).episode_info is not None
    (folder / "iter-000002.rank-1.safetensors").unlink()
    with pytest.raises(ValueError, match="share of rank-1 is missing"):
        load_iteration(folder, 2, pad_id=9)
    with pytest.raises(FileNotFoundError) as caught:
        load_batch(folder, 2, 1)
    assert str(caught.value) == f"{folder / 'iter-000002.rank-1.safetensors'} is missing: iteration 2 was not recorded"


def test_recording_initial_weights_from_the_trainer_at_iteration_zero_only(tmp_path, monkeypatch):
    from stppo_agent.models import loading
    from stppo_agent.runs.recording import RolloutRecorder

    saved = []

    def save_policy(folder, actor, tok, critic, actor_state, critic_state):
        assert tok is words
        saved.append((folder.name, actor, critic, actor_state, critic_state))
        (folder / "actor").mkdir(parents=True)
        (folder / "actor" / "w").write_text(actor)

    words = tokenizer()
    monkeypatch.setattr(loading, "save_policy", save_policy)
    calls = []
    monkeypatch.setattr(RolloutRecorder, "save_initial", lambda self, *args: calls.append((self.rank, *args)))

    def recorder_at(iteration, critic_model, rank=0):
        return RolloutRecorder.for_run(tmp_path / "run", tokenizer(), rank, 2, iteration=iteration, actor="A",
                                       critic="C", critic_model=critic_model, full_states=lambda: ("AS", "CS"))

    recorder = recorder_at(0, None)
    assert (recorder.folder, recorder.rank, recorder.world) == (tmp_path / "run" / "rollouts", 0, 2)
    assert calls == [(0, "A", None, "AS", None)]  # a critic built from the actor is rebuilt on replay
    recorder_at(0, "critic-path", rank=1)
    assert calls[-1] == (1, "A", "C", "AS", "CS")
    recorder_at(3, "critic-path")
    assert len(calls) == 2  # a resumed run's initial weights are already recorded
    monkeypatch.undo()
    monkeypatch.setattr(loading, "save_policy", save_policy)

    folder = tmp_path / "run" / "rollouts"
    RolloutRecorder(tmp_path / "run", words, 1, 2).save_initial("A1", None)
    assert saved == [] and not (folder / "initial").exists()
    RolloutRecorder(tmp_path / "first", words, 0, 1).save_initial("A0", None)  # nothing to replace yet
    assert (tmp_path / "first" / "rollouts" / "initial" / "actor" / "w").read_text() == "A0"
    saved.clear()
    (folder / ".initial.tmp" / "junk").mkdir(parents=True)  # left by an interrupted save
    (folder / "initial" / "old").mkdir(parents=True)
    RolloutRecorder(tmp_path / "run", words, 0, 2).save_initial("A2", "C2", {"a": 1}, {"c": 1})
    assert saved == [(".initial.tmp", "A2", "C2", {"a": 1}, {"c": 1})]
    assert sorted(p.name for p in (folder / "initial").iterdir()) == ["actor"]
    assert (folder / "initial" / "actor" / "w").read_text() == "A2" and not (folder / ".initial.tmp").exists()
    RolloutRecorder(tmp_path / "run", words, 0, 2).save_initial("A3", None)
    assert saved[-1] == (".initial.tmp", "A3", None, None, None)
    assert (folder / "initial" / "actor" / "w").read_text() == "A3"


def test_recording_transcripts_keep_special_tokens_and_an_empty_response(tmp_path):
    from stppo_agent.rollouts.batch import RolloutBatch
    from stppo_agent.runs.recording import RolloutRecorder

    batch = RolloutBatch(
        input_ids=torch.tensor([[1, 3, 5, 6, 1], [0, 3, 0, 0, 0]]),
        attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 1, 0, 0, 0]]), prompt_width=2,
        response_ids=torch.tensor([[5, 6, 1], [0, 0, 0]]), loss_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]).bool(),
        turn_ids=torch.tensor([[0, 0, 0], [-1, -1, -1]]), sample_logprobs=torch.zeros(2, 3),
        rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]), terminated=torch.tensor([True, False]),
        truncated=torch.tensor([False, True]), stats={})
    RolloutRecorder(tmp_path, tokenizer(), 0, 1).record(1, batch)
    records = [json.loads(line) for line in (tmp_path / "rollouts" / "iter-000001.rank-0.jsonl").read_text()
               .splitlines()]
    assert [r["transcript"] for r in records] == [
        [["prompt", -1, "<eos> say"], ["policy", 0, "red green <eos>"]],  # special tokens kept as sampled
        [["prompt", -1, "say"]]]  # nothing sampled: no response segment
