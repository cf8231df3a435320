"""``stppo replay`` (stppo_agent/cli/replay.py): its defaults and options, and a folder that
holds a run: refused with the flags replay takes, ``--resume`` continuing an interrupted replay exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stppo_agent.cli import main
from stppo_agent.models.tiny import build_tiny_llama, toy_train_command, word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics
from tests.support.cli_calls import Calls, run, usage_error
from tests.support.cli_in_process import stppo
from tests.support.runs import TIMING

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


# ``stppo replay`` into a folder that holds a run: refused with the flags replay itself takes; ``--resume`` continues
# an interrupted replay exactly where it stopped, ``--overwrite`` replaces it.


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recorded")
    model = build_tiny_llama(root / "model", word_tokenizer())
    run = root / "run"
    assert main(toy_train_command(model, run, 3, extra=("logging.save_rollouts=true",
                                                        "monitor.on_collapse=none"))[3:]) == 0
    return run


def replay(recorded: Path, out: Path, *flags: str, capsys):
    return stppo("replay", str(recorded), "--output-dir", str(out), *flags, capsys=capsys)


def test_an_interrupted_replay_resumes_to_what_an_uninterrupted_one_logs(recorded, tmp_path, capsys):
    whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
    assert replay(recorded, whole, capsys=capsys).returncode == 0
    assert replay(recorded, interrupted, "--iterations", "2", capsys=capsys).returncode == 0

    refused = replay(recorded, interrupted, capsys=capsys)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "already holds a run" in refused.stderr and "--resume" in refused.stderr and "--overwrite" in refused.stderr

    resumed = replay(recorded, interrupted, "--resume", capsys=capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {interrupted / 'checkpoints' / 'step-2'}" in resumed.stdout
    expected, got = read_metrics(whole), read_metrics(interrupted)
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(expected, got):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
    assert [r["step"] for r in read_metrics(interrupted, "steps.jsonl")] == \
        [r["step"] for r in read_metrics(whole, "steps.jsonl")]


def test_overwrite_replaces_a_replay(recorded, tmp_path, capsys):
    out = tmp_path / "out"
    assert replay(recorded, out, capsys=capsys).returncode == 0
    again = replay(recorded, out, "--overwrite", "--iterations", "1", capsys=capsys)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [r["step"] for r in read_metrics(out)] == [1]
    both = replay(recorded, out, "--resume", "--overwrite", capsys=capsys)
    assert both.returncode == 1 and "pass one" in both.stderr
