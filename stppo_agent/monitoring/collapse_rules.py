"""Collapse early warning: every iteration's metrics compared with the run's own recent history.

Runs that collapse (reward falling to zero after hundreds of good steps, as Search-R1 and others report) show it
first in their update statistics: importance-ratio tails widen, clip fractions climb, entropy explodes or
collapses, the KL to the reference spikes, gradients blow up, invalid actions and response lengths jump. Each
such **signal** is scored against its last ``monitor.window`` iterations with a robust z-score,

    z = (x - median(history)) / max(1.4826 * MAD(history), floor)

(in log space for ratios and gradient norms, whose scale is multiplicative), and **trips** when z passes
``monitor.z`` in its bad direction. ``floor`` is a per-signal smallest change that can count (a run whose
clip fraction sat at exactly 0 would otherwise trip on the first clipped token). The reward's **drawdown** trips
when the iteration's reward falls more than ``monitor.drawdown`` of the way below the running best of its moving
average, and further than its noise explains (3 robust standard deviations of the iteration-to-iteration
changes): small batches of a hard task have rewards that jump between 0 and 0.5 by chance.

A signal may also have an absolute **limit** (``monitor.thresholds``, default ``kl_to_reference: 1.0`` nat per
token, far above what a KL-regularised run reaches): above it, it trips from the first iteration, warm-up or not.

Correlated signals are grouped in families (the ratio tails and clip fractions are one family, "off-policy"). An
**alarm** is raised when at least ``monitor.min_families`` families trip in one iteration, or one family trips
in ``monitor.patience`` consecutive iterations. Nothing trips during the first ``monitor.warmup`` iterations.

What the trainer does with an alarm (``monitor.on_collapse``) lives in :mod:`stppo_agent.monitoring.collapse_guard`;
this module only reads numbers, so it is also what rebuilds the monitor's state from ``metrics.jsonl`` on resume.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from statistics import median
from typing import Any, Iterable, Mapping, Sequence

from stppo_agent.runs.checkpoint_health import REWARD_KEY, finite_number
from stppo_envs.suggest import did_you_mean

ACTIONS = ("none", "warn", "stop", "rollback")


def check_action(on_collapse: str) -> None:
    """``monitor.on_collapse`` is one of :data:`ACTIONS` (ValueError, one line, with the closest one)."""
    if on_collapse not in ACTIONS:
        raise ValueError(f"monitor.on_collapse must be one of {', '.join(ACTIONS)}, got {on_collapse!r}"
                         f"{did_you_mean(str(on_collapse), ACTIONS)}")


@dataclasses.dataclass(frozen=True)
class Signal:
    key: str
    """The metric's key in the iteration's metrics (absent metrics are skipped: no critic, no reference, ...)."""
    family: str
    direction: str
    """up, down or both: which way is bad."""
    floor: float
    """Smallest scale of a change (in log units when ``log``): a deviation below ``monitor.z * floor`` never
    trips, however flat the history."""
    log: bool = False


SIGNALS = (
    Signal("tail/ratio_max", "off-policy", "up", 0.05, log=True),
    Signal("tail/ratio_p99", "off-policy", "up", 0.03, log=True),
    Signal("tail/turn_ratio_max", "off-policy", "up", 0.05, log=True),
    Signal("tail/turn_ratio_p99", "off-policy", "up", 0.03, log=True),
    Signal("clip_frac", "off-policy", "up", 0.03),
    Signal("turn_clip_frac", "off-policy", "up", 0.03),
    Signal("clip_bias_scale", "off-policy", "down", 0.05),
    Signal("entropy", "entropy", "both", 0.1),
    Signal("kl_to_reference", "kl", "up", 0.02),
    # Linear, with a floor of a quarter of the usual max_grad_norm (1.0): a converged policy's norm of 1e-3 that
    # returns to 0.5 is learning, not an explosion; an explosion is several times the clipping threshold.
    Signal("grad_norm", "gradient", "up", 0.25),
    Signal("invalid_action_rate", "actions", "up", 0.05),
    Signal("response_tokens", "length", "both", 0.15, log=True),
)

SKIPPED_KEY = "skipped"
"""Optimizer steps the iteration skipped for a NaN/inf loss or gradient (logged only when there were some): any
trips, from the first iteration on, as a signal's absolute limit does."""


@dataclasses.dataclass(frozen=True)
class MonitorSettings:
    window: int = 20
    warmup: int = 5
    z: float = 6.0
    patience: int = 2
    min_families: int = 2
    drawdown: float = 0.5
    reward_smoothing: float = 0.5
    """Weight of the newest reward in its moving average (1: no smoothing)."""
    thresholds: tuple[tuple[str, float], ...] = ()
    """(metric key, absolute limit) pairs: above its limit a signal trips, history or not."""

    @classmethod
    def from_config(cls, config) -> "MonitorSettings":
        return cls(window=config.monitor.window, warmup=config.monitor.warmup, z=config.monitor.z,
                   patience=config.monitor.patience, min_families=config.monitor.min_families,
                   drawdown=config.monitor.drawdown,
                   thresholds=tuple(sorted((k, float(v)) for k, v in (config.monitor.thresholds or {}).items())))

    def validate(self) -> None:
        if self.window < 2 or self.warmup < 2 or self.warmup > self.window:
            raise ValueError(f"monitor.warmup ({self.warmup}) must be >= 2 and <= monitor.window ({self.window})")
        if self.z <= 0 or self.patience < 1 or self.min_families < 1:
            raise ValueError("monitor.z must be > 0, monitor.patience and monitor.min_families >= 1")
        if not 0 < self.drawdown <= 1:
            raise ValueError(f"monitor.drawdown must be in (0, 1], got {self.drawdown}")
        known = {signal.key for signal in SIGNALS}
        for key, _ in self.thresholds:
            if key not in known:
                raise ValueError(f"monitor.thresholds: {key!r} is not a monitored signal; known: "
                                 f"{', '.join(sorted(known))}")


@dataclasses.dataclass
class Trip:
    """One signal out of its recent range in one iteration."""

    key: str
    family: str
    value: float
    z: float
    low: float
    high: float
    """The recent range (min, max of the history window) it left."""
    limit: float | None = None
    """Set when it tripped by passing its absolute limit."""

    def describe(self) -> str:
        if self.limit is not None:
            return f"{self.key} {self.value:.4g} (above its limit {self.limit:.4g})"
        if self.key == "reward_drawdown":
            return f"reward {self.value:.3g} is {self.z:.0%} below its best moving average {self.high:.3g}"
        return f"{self.key} {self.value:.4g} (recent {self.low:.4g}..{self.high:.4g}, z={self.z:+.1f})"


@dataclasses.dataclass
class Verdict:
    """What one iteration's metrics say."""

    iteration: int
    trips: list[Trip]
    alarm: bool
    onset: int | None = None
    """With an alarm: the first iteration of the streak of tripped iterations that raised it."""
    warming_up: bool = False
    """Too little history to judge this iteration by its z-scores (absolute limits still apply)."""

    def describe(self) -> str:
        return "; ".join(trip.describe() for trip in self.trips) or "no signal"

    def metrics(self) -> dict[str, Any]:
        """What goes into the iteration's record of ``metrics.jsonl``."""
        out: dict[str, Any] = {"collapse/tripped": len(self.trips)}
        if self.warming_up:
            out["collapse/warmup"] = 1
        if self.trips:
            out["collapse/signals"] = ",".join(trip.key for trip in self.trips)
        for trip in self.trips:
            out[f"collapse/z/{trip.key}"] = trip.z
        if self.alarm:
            out["collapse/alarm"] = 1
            out["collapse/onset"] = self.onset
        return out


class CollapseMonitor:
    """Feed it every iteration's metrics with :meth:`observe`; it says which signals tripped and whether that
    is an alarm. :meth:`forget_after` drops the history of iterations a rollback undid."""

    def __init__(self, settings: MonitorSettings = MonitorSettings(), signals: Sequence[Signal] = SIGNALS):
        settings.validate()
        self.settings, self.signals = settings, tuple(signals)
        self.history: dict[str, deque[tuple[int, float]]] = {s.key: deque(maxlen=settings.window) for s in signals}
        # (iteration, moving average, running best, raw reward)
        self.reward_history: list[tuple[int, float, float, float]] = []
        self.streaks: dict[str, int] = {}  # family -> consecutive tripped iterations, ending at the last one
        self.streak_start: int | None = None
        self.seen = 0

    # -- reading one iteration -------------------------------------------------------------------------------
    def observe(self, iteration: int, metrics: Mapping[str, Any], learn: bool = True) -> Verdict:
        """Score ``metrics`` against the history, then (``learn``) add them to it."""
        warming_up = self.seen < self.settings.warmup
        trips = [trip for signal in self.signals if (trip := self._score(signal, metrics)) is not None]
        drawdown = self._drawdown(iteration, metrics.get(REWARD_KEY), learn)
        if drawdown is not None:
            trips.append(drawdown)
        skipped = finite_number(metrics.get(SKIPPED_KEY))
        if skipped:  # a NaN/inf loss or gradient: its other signals are missing from that step, so it trips itself
            trips.append(Trip(SKIPPED_KEY, "non-finite", skipped, math.inf, 0.0, 0.0, limit=0.0))
        families = {trip.family for trip in trips}
        self.streaks = {family: self.streaks.get(family, 0) + 1 for family in families}
        if not trips:
            self.streak_start = None
        elif self.streak_start is None:
            self.streak_start = iteration
        alarm = len(families) >= self.settings.min_families or \
            any(count >= self.settings.patience for count in self.streaks.values())
        if learn:
            for signal in self.signals:
                value = finite_number(metrics.get(signal.key))
                if value is not None:
                    self.history[signal.key].append((iteration, _transform(signal, value)))
            self.seen += 1
        return Verdict(iteration, trips, alarm, self.streak_start if alarm else None, warming_up)

    def _score(self, signal: Signal, metrics: Mapping[str, Any]) -> Trip | None:
        value = finite_number(metrics.get(signal.key))
        limit = dict(self.settings.thresholds).get(signal.key)
        if value is not None and limit is not None and value > limit:
            return Trip(signal.key, signal.family, value, math.inf, limit, limit, limit=limit)
        past = [v for _, v in self.history[signal.key]]
        if value is None or len(past) < self.settings.warmup:
            return None
        x = _transform(signal, value)
        centre = median(past)
        spread = 1.4826 * median([abs(v - centre) for v in past])
        z = (x - centre) / max(spread, signal.floor)
        bad = z > self.settings.z if signal.direction == "up" else \
            z < -self.settings.z if signal.direction == "down" else abs(z) > self.settings.z
        if not bad:
            return None
        low, high = min(past), max(past)
        if signal.log:
            low, high = math.exp(low), math.exp(high)
        return Trip(signal.key, signal.family, value, z, low, high)

    def _drawdown(self, iteration: int, reward: Any, learn: bool) -> Trip | None:
        reward = finite_number(reward)
        if reward is None:
            return None
        alpha = self.settings.reward_smoothing
        previous = self.reward_history[-1] if self.reward_history else None
        average = reward if previous is None else alpha * reward + (1 - alpha) * previous[1]
        best = max(previous[2], average) if previous is not None else average
        trip = None
        recent = [raw for _, _, _, raw in self.reward_history[-self.settings.window:]]
        if previous is not None and len(recent) >= self.settings.warmup and previous[2] > 0:
            # The reward's noise from consecutive differences (a learning curve's trend does not inflate it):
            # sd = 1.4826 * MAD(diffs) / sqrt(2).
            diffs = [b - a for a, b in zip(recent, recent[1:])]
            noise = 1.4826 * median([abs(d - median(diffs)) for d in diffs]) / math.sqrt(2)
            fall = previous[2] - reward
            if fall > self.settings.drawdown * previous[2] and fall > 3 * noise:
                trip = Trip("reward_drawdown", "reward", reward, fall / previous[2], reward, previous[2])
        if learn:
            self.reward_history.append((iteration, average, best, reward))
        return trip

    # -- after a rollback and on resume ----------------------------------------------------------------------
    def forget_after(self, iteration: int) -> None:
        """Drop what was learned from iterations after ``iteration`` (weights a rollback threw away): the
        baseline is the healthy run again, not the collapse."""
        for key, values in self.history.items():
            kept = [(i, v) for i, v in values if i <= iteration]
            values.clear()
            values.extend(kept)
        self.reward_history = [entry for entry in self.reward_history if entry[0] <= iteration]
        self.streaks, self.streak_start = {}, None

    def reobserve(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Rebuild the state from a run's ``metrics.jsonl`` records (on resume), rollbacks included."""
        for record in records:
            step = int(record.get("step", 0))
            rolled_back_to = record.get("collapse/rollback_to")
            self.observe(step, record)  # as the guard did: observe, then forget what a rollback undid
            if rolled_back_to is not None:
                self.forget_after(int(rolled_back_to))


def _transform(signal: Signal, value: float) -> float:
    return math.log(max(value, 1e-12)) if signal.log else value
