"""``stppo_agent.monitoring.collapse_guard``: the decision each alarm
gets -- warn, stop or roll back to the newest healthy checkpoint -- and the guard's history across resumes and ranks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from stppo_agent.monitoring.collapse_guard import CONTINUE, CollapseGuard, Decision, stop_advice
from stppo_agent.training.config import TrainConfig, from_dict, merged


# -- the guard -----------------------------------------------------------------------------------------------------
def make_checkpoint(run_dir: Path, step: int) -> Path:
    folder = run_dir / "checkpoints" / f"step-{step}"
    folder.mkdir(parents=True)
    data = f"weights {step}".encode()
    (folder / "w.bin").write_bytes(data)
    (folder / "optimizer_state.pt").write_bytes(data)  # a rollback restores it
    manifest = {name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                for name in ("w.bin", "optimizer_state.pt")}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def guard_config(**config) -> TrainConfig:
    values = dict(env="stppo/Toy-v0",
                  monitor=dict(window=20, warmup=2, z=6.0, patience=2, min_families=2, drawdown=0.5, thresholds={},
                               on_collapse="rollback", max_rollbacks=2, rollback_lr_factor=0.5),
                  optimizer=dict(actor_lr=1e-3), checkpoint=dict(every=3))
    values = merged(values, config)
    return from_dict(values)


QUIET = {"grad_norm": 1.0, "entropy": 1.0, "reward": 0.5}
COLLAPSE = {"grad_norm": 9.0, "entropy": 3.0, "reward": 0.5}


def quiet_run(tmp_path: Path, iterations: int = 6, **config) -> CollapseGuard:
    guard = CollapseGuard(guard_config(**config), tmp_path)
    for i in range(1, iterations + 1):
        metrics = dict(QUIET)
        assert guard.check(i, metrics) == CONTINUE and "collapse/action" not in metrics
        make_checkpoint(tmp_path, i)
    return guard


def test_rollback_goes_to_the_newest_healthy_valid_checkpoint(tmp_path):
    guard = quiet_run(tmp_path, iterations=7)
    (tmp_path / "checkpoints" / "step-6" / "w.bin").write_bytes(b"corrupt")  # fails its checksum
    metrics = dict(COLLAPSE)
    decision = guard.check(8, metrics)
    # healthy and valid: 3, 4, 5 (7 is not healthy: iteration 8 sampled with its weights; 6 is corrupt): the newest
    assert decision == Decision("rollback", decision.reason, rollback_to=5) and not decision.stops
    assert decision.rolls_back and decision.alarmed
    assert metrics["collapse/action"] == "rollback" and "collapse/rollback_to" not in metrics  # the loop's to add
    assert metrics["collapse/alarm"] == 1 and metrics["collapse/onset"] == 8
    assert "Rolling back to step-5 with the actor learning rate x0.5, now 0.0005 (rollback 1 of at most 2)" \
        in decision.reason
    assert decision.reason.startswith("collapse alarm at iteration 8 (signals since iteration 8): entropy 3 (recent "
                                      "1..1, z=+20.0); grad_norm 9 (recent 1..1, z=+32.0). Rolling back")
    # deciding changed nothing: the checkpoints, the history and the count move once the rollback is carried out
    assert len(list((tmp_path / "checkpoints").glob("step-*"))) == 7 and guard.rollbacks == 0
    guard.rolled_back(decision.rollback_to)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [".collapsed-step-6", ".collapsed-step-7", "step-1", "step-2", "step-3", "step-4", "step-5"]
    assert max(i for i, _ in guard.monitor.history["grad_norm"]) == 5 and guard.rollbacks == 1
    assert guard.records[-1] == {"step": 8, "reward": 0.5, "collapse/tripped": 2, "collapse/alarm": 1}

    second = guard.check(9, dict(COLLAPSE), actor_lr_scale=0.5)  # the compounded rate is what the reason says
    assert second.action == "rollback" and "x0.5, now 0.00025 (rollback 2 of at most 2)" in second.reason
    guard.rolled_back(second.rollback_to)
    third = guard.check(10, dict(COLLAPSE), actor_lr_scale=0.25)
    assert third.action == "stop" and third.stops and third.rollback_to is None and not third.rolls_back
    assert third.reason.endswith(". Already rolled back 2 time(s) (monitor.max_rollbacks=2): stopping; the newest "
                                 "healthy checkpoint is step-5. The collapse is not only the learning rate: check "
                                 "the rewards and the data, or lower optimizer.actor_lr and clip_high further.")


def test_warn_and_stop_decide_without_touching_checkpoints(tmp_path):
    guard = quiet_run(tmp_path, monitor=dict(on_collapse="warn"))
    metrics = dict(COLLAPSE)
    decision = guard.check(7, metrics)
    assert decision.action == "warn" and not decision.stops and decision.rollback_to is None and decision.alarmed
    assert "Training continues (monitor.on_collapse=warn); the newest healthy checkpoint is step-5." in decision.reason
    assert metrics["collapse/action"] == "warn" and "collapse/rollback_to" not in metrics
    assert len(list((tmp_path / "checkpoints").glob("step-*"))) == 6

    stopping = quiet_run(tmp_path / "stop", monitor=dict(on_collapse="stop")).check(7, dict(COLLAPSE))
    assert stopping.stops and "Stopping (monitor.on_collapse=stop); the newest healthy checkpoint is step-5." in \
        stopping.reason
    assert stop_advice(stopping, Path("/x/step-7")) == f"{stopping.reason} The state at the alarm is saved in " \
                                                       "/x/step-7."


def test_a_decision_is_one_of_four_and_only_a_rollback_names_a_step():
    assert CONTINUE == Decision("continue", "") and not (CONTINUE.alarmed or CONTINUE.stops or CONTINUE.rolls_back)
    assert Decision("warn", "w").alarmed and not Decision("warn", "w").stops
    assert Decision("stop", "s").stops and not Decision("stop", "s").rolls_back
    back = Decision("rollback", "r", rollback_to=3)
    assert back.rolls_back and back.alarmed and not back.stops and back.rollback_to == 3
    with pytest.raises(ValueError, match="a decision is one of continue, warn, stop, rollback, not 'pause'"):
        Decision("pause", "p")
    with pytest.raises(ValueError, match="a rollback, and only a rollback, names the checkpoint step"):
        Decision("rollback", "r")
    with pytest.raises(ValueError, match="a rollback, and only a rollback, names the checkpoint step"):
        Decision("stop", "s", rollback_to=2)


def test_no_healthy_checkpoint_stops_and_a_spent_budget_stops(tmp_path):
    guard = quiet_run(tmp_path, iterations=2)  # both warm-up iterations: nothing known healthy
    decision = guard.check(3, dict(COLLAPSE))
    assert decision.stops
    assert decision.reason.endswith(". Cannot roll back: no checkpoint is known healthy (checkpoints every "
                                    "checkpoint.every=3 iterations; a healthy one needs two quiet iterations). "
                                    "Stopping; lower optimizer.actor_lr, or save more often.")
    spent = quiet_run(tmp_path / "spent", monitor=dict(max_rollbacks=0))
    assert spent.check(7, dict(COLLAPSE)).stops
    one = quiet_run(tmp_path / "one", monitor=dict(max_rollbacks=1))
    assert one.check(7, dict(COLLAPSE)).action == "rollback"


def test_guard_resumes_from_the_metrics_log_and_protects_healthy_and_best(tmp_path):
    records = [{"step": i, "reward": r, "grad_norm": 1.0, "collapse/tripped": 0, "other": 1}
               for i, r in enumerate([0.1, 0.9, 0.2, 0.3, 0.4, 0.5], start=1)]
    records[0]["collapse/warmup"] = 1
    records[3]["collapse/rollback_to"] = 2
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for step in (1, 2, 3, 4, 5):
        make_checkpoint(tmp_path, step)
    guard = CollapseGuard(guard_config(), tmp_path)
    assert guard.rollbacks == 1
    assert guard.records[0] == {"step": 1, "reward": 0.1, "collapse/tripped": 0, "collapse/warmup": 1}
    assert [i for i, _ in guard.monitor.history["grad_norm"]] == [1, 2, 5, 6]  # 3 and 4 were rolled back
    # healthy: 2..5; best by the next iteration's reward: step 1 -> 0.9 is warm-up, so step 5 (0.5) and the newest
    assert guard.protected_steps() == {5}
    guard.records[2]["reward"] = 0.95  # step 2's weights sampled 0.95
    assert guard.protected_steps() == {2, 5}
    guard.records = [{"step": 1, "reward": 0.9, "collapse/tripped": 0, "collapse/warmup": 1}]
    assert guard.protected_steps() == set()  # nothing healthy: nothing to protect


def test_other_ranks_keep_no_records_and_count_rollbacks_from_zero(tmp_path, monkeypatch):
    from stppo_agent.distributed import process_group

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "collapse/rollback_to": 0, "grad_norm": 1.0}) + "\n")
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2)
    monkeypatch.setattr(process_group, "is_main", lambda: False)
    guard = CollapseGuard(guard_config(), tmp_path)
    assert guard.records == [] and guard.rollbacks == 0 and guard.monitor.seen == 0  # rank 0 reads the log
    assert guard.check(2, dict(COLLAPSE)) == CONTINUE and guard.monitor.seen == 0  # rank 0 decides
    guard.rolled_back(1)  # what every rank does after carrying out rank 0's decision
    assert guard.rollbacks == 1
    assert (tmp_path / "checkpoints" / "step-2").is_dir()  # rank 0 alone moves checkpoints aside


def test_every_rank_gets_rank_zeros_decision(tmp_path, monkeypatch):
    from stppo_agent.distributed import process_group

    gathered = []

    def all_gather_objects(obj):
        gathered.append(obj)
        return [obj if process_group.is_main() else Decision("rollback", "rank 0 says", rollback_to=1), None]

    monkeypatch.setattr(process_group, "all_gather_objects", all_gather_objects)
    alone = quiet_run(tmp_path / "alone")
    assert alone.check(7, dict(COLLAPSE)).action == "rollback" and gathered == []  # one process: no collective
    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    main = quiet_run(tmp_path / "main", monitor=dict(on_collapse="warn"))
    assert gathered == [CONTINUE] * 6  # quiet iterations: rank 0 sends "continue"
    gathered.clear()
    decision = main.check(7, dict(COLLAPSE))
    assert gathered == [decision] and decision.action == "warn"  # rank 0 sends its own decision
    make_checkpoint(tmp_path / "other", 1)
    monkeypatch.setattr(process_group, "is_main", lambda: False)
    other = CollapseGuard(guard_config(), tmp_path / "other")
    metrics: dict = {}
    received = other.check(2, metrics)
    assert gathered[-1] == CONTINUE and received == Decision("rollback", "rank 0 says", rollback_to=1)
    assert metrics == {"collapse/action": "rollback"}  # every rank's metrics say what it is told to do
