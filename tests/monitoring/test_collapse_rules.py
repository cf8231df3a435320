"""``stppo_agent.monitoring.collapse_rules``: the signal table, thresholds on
the right side of strict, warm-up, patience, drawdown and a skipped step's trip. Synthetic numbers only."""

from __future__ import annotations

import dataclasses
import math

import pytest

from stppo_agent.monitoring.collapse_rules import SIGNALS, CollapseMonitor, MonitorSettings, Signal, Trip, Verdict
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.config_sections import MonitorConfig


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


def test_a_skipped_step_trips_with_its_count_and_a_limit_of_zero():
    verdict = CollapseMonitor(MonitorSettings(warmup=3, window=4, patience=2)).observe(1, {"skipped": 2})
    assert verdict.trips == [Trip("skipped", "non-finite", 2, math.inf, 0.0, 0.0, limit=0.0)]


def test_no_skip_is_no_trip():
    monitor = CollapseMonitor(MonitorSettings(warmup=3, window=4, patience=2))
    for metrics in ({"skipped": 0}, {}, {"skipped": math.nan}, {"skipped": None}):
        assert monitor.observe(1, metrics).trips == []
