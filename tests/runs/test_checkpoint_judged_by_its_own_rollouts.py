"""Each checkpoint is judged by the rollouts its own weights sampled: iteration S + 1, or S + 1 + K under
``rollout_staleness`` K (whose iteration i samples with the weights after i - 1 - K updates). That is what
``@healthy``, ``@best`` and a collapse rollback choose by; a checkpoint whose own rollouts' reward is not finite has
no training reward (never the older weights' in its place)."""

from __future__ import annotations

import json
from pathlib import Path

from stppo_agent.models.tiny import toy_train_command
from stppo_agent.runs.metrics_log import read_metrics
from tests.support.cli_in_process import stppo

QUIET = ("checkpoint.keep=20", "monitor.warmup=2", "monitor.z=1000")  # every checkpoint kept, no signal trips


def train(model: Path, run: Path, iterations: int, *sets: str, capsys, resume: bool = False):
    done = stppo(*toy_train_command(model, run, iterations, resume=resume, extra=sets)[3:], capsys=capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def picked(run: Path, which: str, tmp_path: Path, capsys) -> str:
    done = stppo("eval", "--agent", f"hf:{run}@{which}", "--benchmarks", "nq", "--limit", "1", "--max-turns", "1",
                 "--max-new-tokens", "2", "--output-dir", str(tmp_path / which), capsys=capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    return next(line for line in done.stdout.splitlines() if line.startswith("agent "))


def rewrite(run: Path, rewards: dict[int, object], tripped: set[int] = frozenset()) -> None:
    """The run's own records, with the rewards and monitor verdicts a test needs."""
    records = read_metrics(run)
    for record in records:
        record["reward"] = rewards[record["step"]]
        if "collapse/tripped" in record:
            record["collapse/tripped"] = int(record["step"] in tripped)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_with_stale_rollouts_best_and_healthy_use_the_iteration_the_weights_sampled(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny_model, run, 10, "rollout.staleness=2", *QUIET, capsys=capsys)
    assert [r["staleness"] for r in read_metrics(run)] == [0, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    # past the warm-up (iterations 1 and 2), step S's weights sampled iteration S + 3: step-3 -> 6 (0.9), step-4 -> 7,
    # step-5 -> 8; steps 6 and 7 sampled the tripped iterations 9 and 10. Judged by the next iteration instead,
    # step-5 would be best (6's 0.9) and step-7 the newest healthy.
    rewrite(run, {1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1, 5: 0.1, 6: 0.9, 7: 0.2, 8: 0.3, 9: 0.1, 10: 0.5}, tripped={9, 10})
    assert picked(run, "best", tmp_path, capsys) == (
        f"agent hf:{run}@best -> step-3: the healthy checkpoint with the highest training reward (0.900, iteration "
        "6's rollouts: its weights sampled)")
    healthy = picked(run, "healthy", tmp_path, capsys)
    assert healthy == f"agent hf:{run}@healthy -> step-5: the newest healthy checkpoint"


def test_with_stale_rollouts_a_rollback_returns_to_a_checkpoint_whose_own_rollouts_were_quiet(tiny_model, tmp_path,
                                                                                             capsys):
    run = tmp_path / "run"
    train(tiny_model, run, 8, "rollout.staleness=2", *QUIET, capsys=capsys)
    # every iteration from 9 on trips (an absolute limit no response stays under) and alarms at once
    said = train(tiny_model, run, 9, "rollout.staleness=2", *QUIET, "monitor.on_collapse=rollback",
                 "monitor.patience=1",
                 "monitor.thresholds.response_tokens=0.5", capsys=capsys, resume=True)
    alarm = read_metrics(run)[-1]
    assert alarm["step"] == 9 and alarm["collapse/alarm"] and alarm["collapse/action"] == "rollback"
    # step-6's and step-7's weights sampled 9 and 10 (tripped, not yet logged): step-5 (it sampled 8) is the newest
    # known healthy; by the next iteration it would have been step-7
    assert alarm["collapse/rollback_to"] == 5, said.stdout[-2000:]


def test_a_checkpoint_whose_own_rollouts_reward_is_not_finite_is_not_scored_by_the_older_weights(tiny_model, tmp_path,
                                                                                              capsys):
    run = tmp_path / "run"
    train(tiny_model, run, 4, "checkpoint.keep=20", "monitor.on_collapse=none", capsys=capsys)
    # step-1's weights sampled iteration 2, whose reward is NaN: step-1 has no score (iteration 1's 0.95 is the
    # initial weights'), so the best is step-2 (iteration 3's 0.3)
    rewrite(run, {1: 0.95, 2: "nan", 3: 0.3, 4: 0.2})
    assert picked(run, "best", tmp_path, capsys).startswith(
        f"agent hf:{run}@best -> step-2: the checkpoint with the highest training reward (0.300, iteration 3's "
        "rollouts: its weights sampled)")
