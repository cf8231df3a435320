"""Which checkpoints of a run are healthy and which is best, read from its metrics records (the collapse
monitor's verdicts logged per iteration): what the run folder and ``--checkpoint best`` rely on.

A checkpoint is judged by the rollouts its own weights sampled. Checkpoint S holds the weights after S updates;
iteration i's rollouts were sampled by the weights after ``i - 1 - lag`` updates, ``lag`` being the iteration's
logged ``staleness`` (0 without ``rollout.staleness``; K once K updates are done), so S's own rollouts are those of
iteration S + 1 + K (:func:`own_iteration`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

REWARD_KEY = "reward"
STALENESS_KEY = "staleness"


def tripped_iterations(records: Iterable[Mapping[str, Any]]) -> set[int]:
    return {int(r["step"]) for r in records if finite_number(r.get("collapse/tripped")) or r.get("collapse/alarm")}


def sampled_by(record: Mapping[str, Any]) -> int:
    """Updates done to the weights that sampled a record's rollouts."""
    lag = finite_number(record.get(STALENESS_KEY))
    return int(record["step"]) - 1 - (int(lag) if lag is not None else 0)


def own_iteration(records: Sequence[Mapping[str, Any]], step: int) -> int | None:
    """The first logged iteration whose rollouts checkpoint ``step``'s weights sampled (None: the run ended first)."""
    return next((int(r["step"]) for r in records if "step" in r and sampled_by(r) == step), None)


def healthy_steps(records: Sequence[Mapping[str, Any]], steps: Iterable[int]) -> list[int]:
    """Checkpoint steps known to be healthy: iteration S (whose update made the weights) and the iteration whose
    rollouts those weights sampled (:func:`own_iteration`: S + 1, or S + 1 + K under ``rollout.staleness`` K) were
    both judged by the monitor (``collapse/tripped`` logged: an unmonitored iteration vouches for nothing), past its
    warm-up, and neither tripped a signal."""
    logged = {int(r["step"]) for r in records if "step" in r and "collapse/tripped" in r
              and not r.get("collapse/warmup")}
    tripped = tripped_iterations(records)
    healthy = []
    for step in steps:
        own = own_iteration(records, step)
        if own is not None and {step, own} <= logged and not {step, own} & tripped:
            healthy.append(step)
    return sorted(healthy)


def checkpoint_score(records: Sequence[Mapping[str, Any]], step: int) -> tuple[float | None, int | None]:
    """(the training reward of a checkpoint's weights, the iteration it comes from): the reward of the rollouts
    those weights sampled (:func:`own_iteration`; None when it is not a finite number), or, for the newest
    checkpoints, whose weights sampled nothing before the run ended, iteration ``step``'s."""
    by_step = {int(r["step"]): r for r in records if "step" in r}
    own = own_iteration(records, step)
    iteration = own if own is not None else step
    value = finite_number(by_step.get(iteration, {}).get(REWARD_KEY))
    return (value, iteration) if value is not None else (None, None)


def checkpoint_reward(records: Sequence[Mapping[str, Any]], step: int) -> float | None:
    """:func:`checkpoint_score`'s reward."""
    return checkpoint_score(records, step)[0]


def monitored(records: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the collapse monitor judged any of a run's iterations (not with ``monitor.on_collapse=none``)."""
    return any("collapse/tripped" in r for r in records)


def best_step(records: Sequence[Mapping[str, Any]], steps: Iterable[int], healthy_only: bool = True) -> int | None:
    """The healthy checkpoint with the highest :func:`checkpoint_reward` (the newest among equals); with
    ``healthy_only=False`` (a run without a monitor) the highest among all ``steps``."""
    candidates = healthy_steps(records, steps) if healthy_only else list(steps)
    scored = [(checkpoint_reward(records, s), s) for s in candidates]
    scored = [(reward, s) for reward, s in scored if reward is not None]
    return max(scored)[1] if scored else None


def finite_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
