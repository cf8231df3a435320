"""A run trained under ``checkpoint_optimizer=newest`` and resumed with ``on_collapse=rollback`` (and ``all``): its
older checkpoints hold no optimizer state, so a rollback may not return to them. At the first alarm the run stops
as ``stop`` does (exit 3, the alarm state saved, ``--resume`` continues past it) instead of crashing on the
restore and losing the iteration."""

from __future__ import annotations

import json
from pathlib import Path

from stppo_agent.models.tiny import toy_train_command
from stppo_agent.runs.metrics_log import read_metrics
from tests.support.cli_in_process import stppo

QUIET = ("checkpoint.keep=20", "monitor.warmup=2", "monitor.z=1000")
ALARM_AT_ONCE = ("monitor.patience=1", "monitor.thresholds.response_tokens=0.5")  # every iteration trips
ROLLBACK = ("checkpoint.optimizer=all", "monitor.on_collapse=rollback")


def holds_resume_state(checkpoint: Path) -> bool:
    return "optimizer_state.pt" in json.loads((checkpoint / "manifest.json").read_text())


def train(model: Path, run: Path, iterations: int, *sets: str, capsys, resume: bool = False):
    return stppo(*toy_train_command(model, run, iterations, resume=resume, extra=sets)[3:], capsys=capsys)


def test_no_rollback_to_a_healthy_checkpoint_without_optimizer_state(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tiny_model, run, 6, *QUIET, "checkpoint.optimizer=newest", capsys=capsys).returncode == 0
    folders = run / "checkpoints"
    assert [s for s in range(1, 7) if holds_resume_state(folders / f"step-{s}")] == [6]
    # steps 3, 4 and 5 are healthy, but only step-6 (whose own rollouts, iteration 7's, trip) can be resumed
    stopped = train(tiny_model, run, 8, *QUIET, *ALARM_AT_ONCE, *ROLLBACK, capsys=capsys, resume=True)
    assert stopped.returncode == 3, stopped.stderr[-2000:]
    assert "collapse alarm at iteration 7" in stopped.stderr and "Cannot roll back" in stopped.stderr
    assert "no healthy checkpoint holds optimizer state" in stopped.stderr
    assert f"--model {folders / 'step-5' / 'actor'}" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7] and records[-1]["collapse/action"] == "stop"
    assert holds_resume_state(folders / "step-7")  # the state at the alarm, saved: resuming goes on from there
    resumed = train(tiny_model, run, 8, "monitor.on_collapse=none", capsys=capsys,
                    resume=True)  # config.yaml's alarm is off
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {folders / 'step-7'} (iteration 7" in resumed.stdout
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_a_rollback_returns_to_the_newest_healthy_checkpoint_holding_optimizer_state(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tiny_model, run, 6, *QUIET, "checkpoint.optimizer=newest", capsys=capsys).returncode == 0
    # three quiet iterations under checkpoint_optimizer=all: step-6 (optimizer state kept) and step-7 become healthy
    assert train(tiny_model, run, 9, *QUIET, "checkpoint.optimizer=all", capsys=capsys, resume=True).returncode == 0
    done = train(tiny_model, run, 10, *QUIET, *ALARM_AT_ONCE, *ROLLBACK, capsys=capsys, resume=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_metrics(run)[-1]["collapse/rollback_to"] == 8  # healthy 3..8; 6, 7 and 8 hold optimizer state
