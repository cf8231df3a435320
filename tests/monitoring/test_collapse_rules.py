"""Pins for the collapse monitors (issue 27): thresholds on the right side, the right history, the right checkpoint
to roll back to, and the no-learning-signal notice. All on synthetic numbers and a fake trainer: no model, no
subprocess."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stppo_agent.monitoring import collapse_guard as guard_module
from stppo_agent.monitoring.collapse_guard import CONTINUE, CollapseGuard, Decision, stop_advice
from stppo_agent.monitoring.collapse_rules import SIGNALS, CollapseMonitor, MonitorSettings, Signal, Trip, Verdict
from stppo_agent.monitoring.learning_signal import LearningSignalNotice, advice, no_signal_reason
from stppo_agent.runs.checkpoint import load_full_model_state
from stppo_agent.training.config import TrainConfig, from_dict, merged
from stppo_agent.training.config_sections import MonitorConfig, RolloutConfig


# -- the rules ---------------------------------------------------------------------------------------------------
def test_the_signal_table_and_default_settings():
    table = {s.key: (s.family, s.direction, s.floor, s.log) for s in SIGNALS}
    assert table == {
        "tail/ratio_max": ("off-policy", "up", 0.05, True), "tail/ratio_p99": ("off-policy", "up", 0.03, True),
        "tail/turn_ratio_max": ("off-policy", "up", 0.05, True),
        "tail/turn_ratio_p99": ("off-policy", "up", 0.03, True), "clip_frac": ("off-policy", "up", 0.03, False),
        "turn_clip_frac": ("off-policy", "up", 0.03, False), "clip_bias_scale": ("off-policy", "down", 0.05, False),
        "entropy": ("entropy", "both", 0.1, False), "kl_to_reference": ("kl", "up", 0.02, False),
        "grad_norm": ("gradient", "up", 0.25, False), "invalid_action_rate": ("actions", "up", 0.05, False),
        "response_tokens": ("length", "both", 0.15, True)}
    assert Signal("x", "f", "up", 0.1).log is False
    assert MonitorSettings() == MonitorSettings(window=20, warmup=5, z=6.0, patience=2, min_families=2,
                                                drawdown=0.5, reward_smoothing=0.5, thresholds=())


def test_settings_from_config_sort_the_limits_and_validate_at_the_boundaries():
    config = TrainConfig(monitor=MonitorConfig(window=7, warmup=3, z=4.5, patience=4, min_families=3, drawdown=0.25,
                                               thresholds={"kl_to_reference": 2, "grad_norm": 9}))
    assert MonitorSettings.from_config(config) == MonitorSettings(
        window=7, warmup=3, z=4.5, patience=4, min_families=3, drawdown=0.25,
        thresholds=(("grad_norm", 9.0), ("kl_to_reference", 2.0)))
    no_limits = dataclasses.replace(config, monitor=dataclasses.replace(config.monitor, thresholds=None))
    assert MonitorSettings.from_config(no_limits).thresholds == ()
    for ok in (dict(window=2, warmup=2), dict(window=5, warmup=5), dict(z=1e-9), dict(patience=1),
               dict(min_families=1), dict(drawdown=1.0), dict(drawdown=1e-9)):
        MonitorSettings(**ok).validate()
    for bad, message in ((dict(window=1, warmup=1), r"monitor.warmup \(1\) must be >= 2 and <= monitor.window \(1\)"),
                         (dict(window=5, warmup=1), "monitor.warmup"), (dict(window=5, warmup=6), "monitor.warmup"),
                         (dict(z=0.0), "^monitor.z must be > 0, monitor.patience and monitor.min_families >= 1$"),
                         (dict(patience=0), "monitor.patience"),
                         (dict(min_families=0), "monitor.min_families >= 1"),
                         (dict(drawdown=0.0), r"monitor.drawdown must be in \(0, 1\], got 0.0"),
                         (dict(drawdown=1.01), "monitor.drawdown")):
        with pytest.raises(ValueError, match=message):
            MonitorSettings(**bad).validate()
    with pytest.raises(ValueError, match="'kl' is not a monitored signal; known: clip_bias_scale, clip_frac, entropy"):
        MonitorSettings(thresholds=(("kl", 1.0),)).validate()
    with pytest.raises(ValueError):
        CollapseMonitor(MonitorSettings(warmup=1))  # the monitor validates what it is given


def test_trip_and_verdict_texts_and_records():
    assert Trip("kl_to_reference", "kl", 1.23456, math.inf, 1.0, 1.0, limit=1.0).describe() == \
        "kl_to_reference 1.235 (above its limit 1)"
    assert Trip("reward_drawdown", "reward", 0.1, 0.75, 0.1, 0.4).describe() == \
        "reward 0.1 is 75% below its best moving average 0.4"
    grad = Trip("grad_norm", "gradient", 9.5, 12.34, 0.5, 0.6)
    assert grad.describe() == "grad_norm 9.5 (recent 0.5..0.6, z=+12.3)"
    clip = Trip("clip_frac", "off-policy", 0.5, 8.0, 0.0, 0.1)
    assert Verdict(3, [], False).describe() == "no signal"
    assert Verdict(3, [grad, clip], True, onset=2).describe() == \
        "grad_norm 9.5 (recent 0.5..0.6, z=+12.3); clip_frac 0.5 (recent 0..0.1, z=+8.0)"
    assert Verdict(3, [], False).metrics() == {"collapse/tripped": 0}
    assert Verdict(3, [], False, warming_up=True).metrics() == {"collapse/tripped": 0, "collapse/warmup": 1}
    assert Verdict(3, [grad], False).metrics() == {"collapse/tripped": 1, "collapse/signals": "grad_norm",
                                                   "collapse/z/grad_norm": 12.34}
    assert Verdict(3, [grad, clip], True, onset=2).metrics() == {
        "collapse/tripped": 2, "collapse/signals": "grad_norm,clip_frac", "collapse/z/grad_norm": 12.34,
        "collapse/z/clip_frac": 8.0, "collapse/alarm": 1, "collapse/onset": 2}


def flat(monitor: CollapseMonitor, key: str, value: float, n: int, start: int = 1) -> None:
    for i in range(start, start + n):
        monitor.observe(i, {key: value})


def test_z_threshold_is_strict_and_uses_median_and_mad():
    monitor = CollapseMonitor(MonitorSettings(warmup=5))
    flat(monitor, "grad_norm", 1.0, 5)
    at = monitor.observe(6, {"grad_norm": 2.5}, learn=False)  # (2.5 - 1) / floor 0.25 = 6.0 exactly: not past it
    assert not at.trips and not at.warming_up
    past = monitor.observe(6, {"grad_norm": 2.5001}, learn=False)
    assert [t.key for t in past.trips] == ["grad_norm"] and past.trips[0].z == pytest.approx(1.5001 / 0.25)
    assert (past.trips[0].low, past.trips[0].high) == (1.0, 1.0)

    spread = CollapseMonitor(MonitorSettings(warmup=5))
    for i, value in enumerate([1.0, 2.0, 3.0, 4.0, 5.0], start=1):
        spread.observe(i, {"grad_norm": value})
    # median 3, MAD 1: the scale is 1.4826, far above the floor
    assert not spread.observe(6, {"grad_norm": 11.8}, learn=False).trips
    trip = spread.observe(6, {"grad_norm": 12.0}, learn=False).trips[0]
    assert trip.z == pytest.approx(9.0 / 1.4826) and (trip.low, trip.high) == (1.0, 5.0)
    assert spread.observe(6, {"grad_norm": 11.8}, learn=False).warming_up is False


def test_directions_and_log_scale():
    both = CollapseMonitor(MonitorSettings(warmup=5))
    flat(both, "entropy", 1.0, 5)
    assert [t.z for t in both.observe(6, {"entropy": 1.7}, learn=False).trips] == [pytest.approx(7.0)]
    assert [t.z for t in both.observe(6, {"entropy": 0.3}, learn=False).trips] == [pytest.approx(-7.0)]
    assert not both.observe(6, {"entropy": 1.5}, learn=False).trips
    assert not both.observe(6, {"entropy": 0.5}, learn=False).trips

    down = CollapseMonitor(MonitorSettings(warmup=5))
    flat(down, "clip_bias_scale", 1.0, 5)
    assert [t.key for t in down.observe(6, {"clip_bias_scale": 0.6}, learn=False).trips] == ["clip_bias_scale"]
    assert not down.observe(6, {"clip_bias_scale": 1.4}, learn=False).trips  # bad only downwards

    assert not down.observe(6, {"clip_bias_scale": 1.0}, learn=False).trips  # unchanged is no trip
    assert not down.observe(6, {"clip_bias_scale": 0.8}, learn=False).trips

    # exact z = +-6 with a floor that is a power of two: the threshold is strict on every side
    exact = CollapseMonitor(MonitorSettings(warmup=5), signals=(Signal("d", "f1", "down", 0.25),
                                                               Signal("b", "f2", "both", 0.25)))
    flat(exact, "d", 1.0, 5)
    flat(exact, "b", 1.0, 5)
    assert not exact.observe(6, {"d": -0.5, "b": -0.5}, learn=False).trips
    assert not exact.observe(6, {"b": 2.5}, learn=False).trips
    assert [t.key for t in exact.observe(6, {"d": -0.5001, "b": 2.5001}, learn=False).trips] == ["d", "b"]

    up = CollapseMonitor(MonitorSettings(warmup=5))
    flat(up, "clip_frac", 0.2, 5)
    assert not up.observe(6, {"clip_frac": 0.0}, learn=False).trips  # bad only upwards

    ratio = CollapseMonitor(MonitorSettings(warmup=5))
    flat(ratio, "tail/ratio_max", 1.0, 5)  # log scale: trips past exp(6 * 0.05) = 1.3499
    assert not ratio.observe(6, {"tail/ratio_max": 1.34}, learn=False).trips
    trip = ratio.observe(6, {"tail/ratio_max": 1.36}, learn=False).trips[0]
    assert trip.z == pytest.approx(math.log(1.36) / 0.05) and (trip.low, trip.high) == (1.0, 1.0)
    assert ratio.history["tail/ratio_max"][0] == (1, 0.0)  # stored as logs

    length = CollapseMonitor(MonitorSettings(warmup=5))
    flat(length, "response_tokens", 40.0, 5)
    zero = length.observe(6, {"response_tokens": 0}, learn=False).trips[0]  # log of a floor, not a crash
    assert zero.z == pytest.approx((math.log(1e-12) - math.log(40.0)) / 0.15)
    assert (zero.low, zero.high) == (pytest.approx(40.0), pytest.approx(40.0))


def test_warm_up_counts_judged_history_and_the_window_bounds_it():
    monitor = CollapseMonitor(MonitorSettings(warmup=3, window=4))
    verdicts = [monitor.observe(i, {"grad_norm": 1.0}) for i in (1, 2, 3)]
    assert [v.warming_up for v in verdicts] == [True, True, True]
    assert monitor.observe(4, {"grad_norm": 9.0}, learn=False).trips  # 3 values of history: judged
    two = CollapseMonitor(MonitorSettings(warmup=3, window=4))
    flat(two, "grad_norm", 1.0, 2)
    assert not two.observe(3, {"grad_norm": 9.0}).trips  # 2 values: still warming up
    assert monitor.observe(4, {"grad_norm": 1.0}).warming_up is False
    flat(monitor, "grad_norm", 3.0, 6, start=5)
    assert list(monitor.history["grad_norm"]) == [(i, 3.0) for i in range(7, 11)]
    assert monitor.seen == 10
    # missing and non-finite values are skipped, not learned
    monitor.observe(11, {"grad_norm": float("nan")})
    monitor.observe(12, {})
    assert [i for i, _ in monitor.history["grad_norm"]] == [7, 8, 9, 10] and monitor.seen == 12
    assert not monitor.observe(13, {"grad_norm": float("inf")}).trips


def test_learn_false_changes_nothing():
    monitor = CollapseMonitor(MonitorSettings(warmup=2))
    monitor.observe(1, {"grad_norm": 1.0, "reward": 0.5})
    before = (dict(monitor.history), list(monitor.reward_history), monitor.seen)
    monitor.observe(2, {"grad_norm": 2.0, "reward": 0.7}, learn=False)
    assert (list(monitor.history["grad_norm"]), monitor.reward_history, monitor.seen) == \
        (list(before[0]["grad_norm"]), before[1], 1)


def test_absolute_limits_are_strict_and_report_their_limit():
    monitor = CollapseMonitor(MonitorSettings(thresholds=(("kl_to_reference", 1.0), ("grad_norm", 5.0))))
    assert not monitor.observe(1, {"kl_to_reference": 1.0, "grad_norm": 5.0}).trips
    verdict = monitor.observe(2, {"kl_to_reference": 1.5, "grad_norm": 4.0})
    (trip,) = verdict.trips
    assert (trip.key, trip.family, trip.value, trip.z, trip.low, trip.high, trip.limit) == \
        ("kl_to_reference", "kl", 1.5, math.inf, 1.0, 1.0, 1.0)
    assert verdict.warming_up and not verdict.alarm  # one family once: no alarm yet
    assert monitor.observe(3, {"kl_to_reference": 1.5}).alarm  # twice in a row: patience 2
    fresh = CollapseMonitor(MonitorSettings(thresholds=(("kl_to_reference", 1.0),)))
    assert [(v.alarm, v.onset) for v in (fresh.observe(1, {"kl_to_reference": 2.0}),
                                         fresh.observe(2, {"kl_to_reference": 2.0}))] == [(False, None), (True, 1)]


def test_patience_min_families_and_onset():
    def monitor(**settings):
        m = CollapseMonitor(MonitorSettings(warmup=5, **settings))
        flat(m, "grad_norm", 1.0, 5)
        return m

    patient = monitor(patience=3)
    verdicts = [patient.observe(i, {"grad_norm": 9.0}) for i in (6, 7, 8)]
    assert [(v.alarm, v.onset) for v in verdicts] == [(False, None), (False, None), (True, 6)]
    again = monitor(patience=2)
    assert [again.observe(i, {"grad_norm": 9.0}).alarm for i in (6, 7)] == [False, True]
    assert again.observe(7, {"grad_norm": 9.0}, learn=False).onset == 6
    quiet = again.observe(8, {"grad_norm": 1.0})
    assert not quiet.alarm and quiet.onset is None and again.streaks == {}
    assert not again.observe(9, {"grad_norm": 9.0}).alarm  # the streak starts over

    mixed = CollapseMonitor(MonitorSettings(warmup=5, patience=2, min_families=3))
    for i in range(1, 6):
        mixed.observe(i, {"grad_norm": 1.0, "entropy": 1.0})
    # a different family each iteration is no streak; two families at once are fewer than three
    assert not mixed.observe(6, {"grad_norm": 9.0, "entropy": 1.0}).alarm
    assert not mixed.observe(7, {"grad_norm": 1.0, "entropy": 3.0}).alarm
    two = mixed.observe(8, {"grad_norm": 1.0, "entropy": 1.0})
    assert not two.alarm
    both = CollapseMonitor(MonitorSettings(warmup=5, patience=5, min_families=2))
    for i in range(1, 6):
        both.observe(i, {"grad_norm": 1.0, "entropy": 1.0})
    verdict = both.observe(6, {"grad_norm": 9.0, "entropy": 3.0})
    assert verdict.alarm and verdict.onset == 6


def test_reward_moving_average_and_best():
    monitor = CollapseMonitor(MonitorSettings(warmup=2))
    for i, reward in enumerate([0.0, 1.0, 1.0, 0.5, 0.5], start=1):
        monitor.observe(i, {"reward": reward})
    assert monitor.reward_history == [(1, 0.0, 0.0, 0.0), (2, 0.5, 0.5, 1.0), (3, 0.75, 0.75, 1.0),
                                      (4, 0.625, 0.75, 0.5), (5, 0.5625, 0.75, 0.5)]
    sharp = CollapseMonitor(MonitorSettings(warmup=2, reward_smoothing=1.0))
    for i, reward in enumerate([0.2, 0.9, 0.4], start=1):
        sharp.observe(i, {"reward": reward})
    assert [(avg, best) for _, avg, best, _ in sharp.reward_history] == [(0.2, 0.2), (0.9, 0.9), (0.4, 0.9)]


def test_drawdown_boundary_warm_up_and_zero_best():
    monitor = CollapseMonitor(MonitorSettings(warmup=5, drawdown=0.5))
    flat(monitor, "reward", 0.8, 5)
    assert not monitor.observe(6, {"reward": 0.4}, learn=False).trips  # exactly half below the best
    (trip,) = monitor.observe(6, {"reward": 0.39}, learn=False).trips
    assert (trip.key, trip.family, trip.value, trip.low, trip.high) == ("reward_drawdown", "reward", 0.39, 0.39, 0.8)
    assert trip.z == pytest.approx(0.41 / 0.8) and trip.limit is None
    assert trip.describe() == "reward 0.39 is 51% below its best moving average 0.8"
    early = CollapseMonitor(MonitorSettings(warmup=5))
    flat(early, "reward", 0.8, 4)
    assert not early.observe(5, {"reward": 0.0}).trips  # 4 rewards of history: still warming up
    zero = CollapseMonitor(MonitorSettings(warmup=2))
    flat(zero, "reward", 0.0, 5)
    assert not zero.observe(6, {"reward": -1.0}).trips  # nothing good to fall from
    dropped = CollapseMonitor(MonitorSettings(warmup=5))
    for i, reward in enumerate([0.8, 0.8, 0.8, 0.8, 0.0], start=1):
        assert not dropped.observe(i, {"reward": reward}).trips
    assert dropped.observe(6, {"reward": 0.0}).trips  # the best (0.8), not the last reward (0), is what fell
    spike = CollapseMonitor(MonitorSettings(warmup=5))
    for i, reward in enumerate([0.2, 0.2, 0.2, 0.2, 1.0], start=1):  # a lucky batch: the best average is 0.6
        spike.observe(i, {"reward": reward})
    assert spike.observe(6, {"reward": 0.25}).trips  # more than half below 0.6, whatever the lucky batch paid
    window = CollapseMonitor(MonitorSettings(warmup=3, window=3))
    for i, reward in enumerate([1.0, 0.0, 1.0, 0.0, 0.9, 0.9, 0.9], start=1):
        window.observe(i, {"reward": reward})
    assert window.observe(8, {"reward": 0.3}).trips  # the old noise left the window: the fall is real


def test_drawdown_against_the_noise_of_consecutive_changes():
    # diffs -0.2, 0.2, -0.2, 0.2: MAD 0.2, noise 1.4826 * 0.2 / sqrt(2) = 0.2097, 3 x noise = 0.629
    monitor = CollapseMonitor(MonitorSettings(warmup=5, drawdown=0.5))
    for i, reward in enumerate([1.0, 0.8, 1.0, 0.8, 1.0], start=1):
        monitor.observe(i, {"reward": reward})
    assert not monitor.observe(6, {"reward": 0.4}, learn=False).trips  # fell 0.6: more than half, within noise
    assert monitor.observe(6, {"reward": 0.35}, learn=False).trips  # fell 0.65: beyond both
    trend = CollapseMonitor(MonitorSettings(warmup=5, drawdown=0.5))
    for i, reward in enumerate([0.2, 0.4, 0.6, 0.8, 1.0], start=1):  # a learning curve: no noise at all
        trend.observe(i, {"reward": reward})
    # the best is the moving average's (0.8125), not the best single reward (1.0)
    assert not trend.observe(6, {"reward": 0.45}, learn=False).trips
    (trip,) = trend.observe(6, {"reward": 0.3}, learn=False).trips
    assert trip.high == pytest.approx(0.8125) and trip.z == pytest.approx(0.5125 / 0.8125)


def test_forget_after_keeps_the_rollback_step_and_resets_the_streak():
    monitor = CollapseMonitor(MonitorSettings(warmup=3))
    for i in range(1, 7):
        monitor.observe(i, {"grad_norm": 1.0, "reward": 0.5})
    monitor.observe(7, {"grad_norm": 9.0, "reward": 0.5})
    monitor.forget_after(4)
    assert [i for i, _ in monitor.history["grad_norm"]] == [1, 2, 3, 4]
    assert [entry[0] for entry in monitor.reward_history] == [1, 2, 3, 4]
    assert monitor.streaks == {} and monitor.streak_start is None
    assert not monitor.observe(8, {"grad_norm": 9.0}).alarm  # the streak before the rollback is gone

    rebuilt = CollapseMonitor(MonitorSettings(warmup=3))
    rebuilt.reobserve([{"grad_norm": 1.0}, {"step": 3, "grad_norm": 2.0, "collapse/rollback_to": 0}])
    assert list(rebuilt.history["grad_norm"]) == [(0, 1.0)]  # a record without a step is step 0


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


# -- learning signal -----------------------------------------------------------------------------------------------
MASK = torch.ones(4, 2, dtype=torch.bool)
GROUPS = torch.tensor([0, 0, 1, 1])


def reason(rewards, group_relative=False, advantages=None, mask=MASK):
    return no_signal_reason(torch.tensor(rewards), GROUPS, advantages, mask, group_relative)


def test_no_signal_reason_boundaries():
    assert reason([0.5, 0.5, 0.5, 0.5 + 9e-7]) == "every trajectory earned the same reward (0.500)"
    assert reason([0.5, 0.5, 0.5, 0.5 + 1e-5]) is None
    assert reason([1e-6] * 4) == "every trajectory's reward is 0"
    assert reason([1e-5] * 4) == "every trajectory earned the same reward (0.000)"
    assert no_signal_reason(torch.zeros(1), torch.zeros(1), None, torch.ones(1, 2, dtype=torch.bool), False) == \
        "every trajectory's reward is 0"  # a batch of one
    assert reason([-1.0] * 4) == "every trajectory earned the same reward (-1.000)"  # a penalty is not 0
    assert reason([0.3, 0.3 + 1e-7, 0.7, 0.7], group_relative=True).startswith("within every group")
    assert reason([0.3, 0.3 + 1e-5, 0.7, 0.7], group_relative=True) is None
    varied = [1.0, 0.0, 0.5, 0.0]
    tiny = torch.full((4, 2), 1e-12)
    assert reason(varied, advantages=tiny) == "every token's advantage is 0"
    assert reason(varied, advantages=torch.full((4, 2), 1e-10)) is None
    masked_out = torch.zeros(4, 2)
    masked_out[:, 1] = 1.0  # advantages only where the loss does not look
    half = torch.zeros(4, 2, dtype=torch.bool)
    half[:, 0] = True
    assert reason(varied, advantages=masked_out, mask=half) == "every token's advantage is 0"
    assert reason(varied, advantages=masked_out, mask=~half) is None
    assert reason(varied, advantages=torch.ones(4, 2), mask=torch.zeros(4, 2, dtype=torch.bool)) == \
        "every token's advantage is 0"
    assert no_signal_reason(torch.zeros(0), torch.zeros(0), None, torch.zeros(0, 2, dtype=torch.bool), False) is None


def config(env: str = "stppo/Toy-v0") -> TrainConfig:
    return TrainConfig(env=env,
                       rollout=RolloutConfig(max_turns=3, max_new_tokens_per_turn=4, temperature=0.7,
                                             samples_per_prompt=5))


def test_advice_texts():
    solved = advice("every trajectory earned the same reward (1.000)", config())
    assert solved == ("no learning signal: every trajectory earned the same reward (1.000), so this update cannot "
                      "learn the task. Likely cause: the task is already solved (or always paid the same) at these "
                      "settings (rollout.max_turns=3, rollout.max_new_tokens_per_turn=4, rollout.temperature=0.7, "
                      "rollout.samples_per_prompt=5). "
                      "Try a harder dataset or split, or a reward that tells answers apart (--set "
                      "env_kwargs.reward=f1). (Said once; metrics.jsonl keeps the per-iteration figures.)")
    toy = advice("every trajectory's reward is 0", config())
    assert toy.startswith("no learning signal: every trajectory's reward is 0, so this update cannot learn the task. "
                          "Likely cause: the model never (or always) produces a rewarded action at these settings "
                          "(rollout.max_turns=3, ")
    assert "Try longer turns (--set rollout.max_new_tokens_per_turn=...), more samples (--set " \
           "rollout.samples_per_prompt=...), a model whose vocabulary holds the env's words (--model tiny on " \
           "stppo/Toy-v0)." in toy
    mixed = advice("every trajectory's reward is 0", config(" stppo/Toy-v0, stppo/NQ-v0 ,"))
    assert "a shaped reward (--set env_kwargs.format_reward=0.2), a warm start (stppo sft)." in mixed


def fake_batch(rewards) -> SimpleNamespace:
    return SimpleNamespace(rewards=torch.tensor(rewards), group_ids=GROUPS, advantages=None, loss_mask=MASK)


def signal_notice(advantage: str = "grpo", world: int = 1) -> tuple[LearningSignalNotice, list[str]]:
    """A notice and what it reports, for a run on the CPU."""
    from stppo_agent.algorithms import ALGORITHMS

    said: list[str] = []
    algo = dataclasses.replace(ALGORITHMS["grpo"], advantage=advantage)
    return LearningSignalNotice(config(), algo, said.append, world, torch.device("cpu")), said


def test_notice_once_per_run_after_a_batch_with_signal():
    notice, said = signal_notice()
    notice.check(fake_batch([1.0, 0.0, 1.0, 0.0]), 4)
    assert said == []
    notice.check(fake_batch([1.0, 1.0, 0.0, 0.0]), 4)  # grpo: equal inside every group
    assert said == [f"iteration 5: {advice(reason([1.0, 1.0, 0.0, 0.0], True), notice.config)}"]
    notice.check(fake_batch([0.0] * 4), 5)
    assert len(said) == 1
    critic, critic_said = signal_notice("gae")  # a critic learns from groups that differ
    critic.check(fake_batch([1.0, 1.0, 0.0, 0.0]), 4)
    assert critic_said == []
    ranks, ranks_said = signal_notice(world=2)  # one process alone: its own batch decides (the all-reduce: identity)
    ranks.check(fake_batch([0.0] * 4), 4)
    assert len(ranks_said) == 1 and "every trajectory's reward is 0" in ranks_said[0]
    paid, paid_said = signal_notice(world=2)
    paid.check(fake_batch([1.0, 0.0, 1.0, 0.0]), 4)
    assert paid_said == []
    flat_advantages = fake_batch([1.0, 0.0, 0.5, 0.0])
    flat_advantages.advantages = torch.zeros(4, 2)
    unlucky, unlucky_said = signal_notice("gae")  # a critic's advantages that came out all 0
    unlucky.check(flat_advantages, 4)
    assert len(unlucky_said) == 1 and "every token's advantage is 0" in unlucky_said[0]


def test_notice_across_processes_asks_every_rank_once(monkeypatch):
    from stppo_agent.distributed import process_group

    sums, others = [], [0.0]

    def all_reduce_sum(value):
        sums.append((value.device, value.shape))
        return torch.tensor(others[0])  # what the other ranks add: one of them had a signal or none did

    monkeypatch.setattr(process_group, "all_reduce_sum", all_reduce_sum)
    alone, alone_said = signal_notice()
    alone.check(fake_batch([0.0] * 4), 4)
    assert sums == [] and len(alone_said) == 1  # a single process makes no collective call
    ranks, ranks_said = signal_notice(world=2)
    ranks.device = torch.device("meta")  # the collective runs on the run's device (NCCL wants CUDA tensors)
    ranks.check(fake_batch([0.0] * 4), 4)
    assert sums == [(torch.device("meta"), torch.Size([]))] and len(ranks_said) == 1
    others[0] = 1.0
    rescued, rescued_said = signal_notice(world=2)
    rescued.check(fake_batch([0.0] * 4), 4)  # another rank's batch had a signal: silent
    assert rescued_said == [] and len(sums) == 2


def test_load_full_model_state_copies_every_tensor_plain_or_sharded(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    source, target = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    load_full_model_state(target, source.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), source.state_dict().values()))
    # a model sharded by FSDP2 (one gloo rank, in this process) takes the whole, unsharded checkpoint state
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
        whole = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
        fully_shard(sharded)
        load_full_model_state(sharded, whole.state_dict())
        assert all(torch.equal(a.full_tensor(), b)
                   for a, b in zip(sharded.state_dict().values(), whole.state_dict().values()))
    finally:
        if owned:
            dist.destroy_process_group()
    assert guard_module.CollapseStopped.__mro__[1] is RuntimeError


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
