"""A run that left its rollout correction to ``auto`` can switch to ``stale_objective=decoupled`` on ``--resume`` or
in ``stppo replay``: config.yaml keeps the ``auto`` the user asked for beside what it resolved to, and the switch
resolves it again (to the decoupled objective's per-token mis)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from stppo_agent.models.tiny import build_tiny_llama, toy_train_command, word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics

from .cli_in_process import stppo


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


def recorded(run: Path) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())


def test_resume_and_replay_switch_an_auto_correction_to_the_decoupled_objective(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    command = toy_train_command(tiny_model, run, 2, extra=("rollout.staleness=1", "logging.save_rollouts=true"))[3:]
    assert stppo(*command, capsys=capsys).returncode == 0
    config = recorded(run)
    assert config["algorithm"]["rollout_correction"] == config["algorithm"]["rollout_correction_level"] == "auto"
    assert config["algorithm_resolved"] == {"rollout_correction": "none", "rollout_correction_level": "turn"}
    assert "rollout_correction/masked_frac" not in read_metrics(run)[-1]

    replayed = tmp_path / "replay"
    done = stppo("replay", str(run), "--output-dir", str(replayed), "--set", "rollout.stale_objective=decoupled",
                 capsys=capsys)
    assert done.returncode == 0, done.stderr
    assert json.loads((replayed / "replay.json").read_text())["rollout_correction"] == "mis"
    assert recorded(replayed)["algorithm"]["rollout_correction_level"] == "token"
    assert all("rollout_correction/masked_frac" in record for record in read_metrics(replayed))

    resumed = stppo(*toy_train_command(tiny_model, run, 3, resume=True,
                                       extra=("rollout.staleness=1", "logging.save_rollouts=true",
                                              "rollout.stale_objective=decoupled"))[3:], capsys=capsys)
    assert resumed.returncode == 0, resumed.stderr
    assert "rollout_correction/masked_frac" in read_metrics(run)[-1] and read_metrics(run)[-1]["step"] == 3
    config = recorded(run)
    assert config["rollout"]["stale_objective"] == "decoupled" and config["algorithm"]["rollout_correction"] == "auto"
    assert config["algorithm_resolved"] == {"rollout_correction": "mis", "rollout_correction_level": "token"}


def test_a_correction_set_by_hand_stays_set(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    command = toy_train_command(tiny_model, run, 1, extra=("rollout.staleness=1", "algorithm.rollout_correction=tis",
                                                           "algorithm.rollout_correction_cap=3"))[3:]
    assert stppo(*command, capsys=capsys).returncode == 0
    config = recorded(run)
    assert config["algorithm"]["rollout_correction"] == "tis" and config["algorithm"]["rollout_correction_cap"] == 3
    assert config["algorithm_resolved"] == {"rollout_correction_level": "turn"}
    resumed = stppo(*toy_train_command(tiny_model, run, 2, resume=True,
                                       extra=("rollout.staleness=1", "rollout.stale_objective=decoupled"))[3:],
                                       capsys=capsys)
    assert resumed.returncode == 0, resumed.stderr
    assert "rollout_correction/truncated_frac" in read_metrics(run)[-1]  # still tis, now per token
    assert recorded(run)["algorithm_resolved"] == {"rollout_correction_level": "token"}
