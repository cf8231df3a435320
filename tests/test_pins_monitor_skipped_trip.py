"""Pins of stppo_agent/monitoring/collapse_rules.py's skipped-step trip: any skipped optimizer step trips the monitor
by itself (its own family, an absolute limit of 0), from the first iteration; 0, absent or non-finite do not."""

from __future__ import annotations

import math

from stppo_agent.monitoring.collapse_rules import CollapseMonitor, MonitorSettings, Trip


def test_a_skipped_step_trips_with_its_count_and_a_limit_of_zero():
    verdict = CollapseMonitor(MonitorSettings(warmup=3, window=4, patience=2)).observe(1, {"skipped": 2})
    assert verdict.trips == [Trip("skipped", "non-finite", 2, math.inf, 0.0, 0.0, limit=0.0)]


def test_no_skip_is_no_trip():
    monitor = CollapseMonitor(MonitorSettings(warmup=3, window=4, patience=2))
    for metrics in ({"skipped": 0}, {}, {"skipped": math.nan}, {"skipped": None}):
        assert monitor.observe(1, metrics).trips == []
