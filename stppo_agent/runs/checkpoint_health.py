"""Which checkpoints of a run are healthy and which is best, read from its metrics records (the collapse
monitor's verdicts logged per iteration): what the run folder and ``--checkpoint best`` rely on."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

REWARD_KEY = "reward"


def tripped_iterations(records: Iterable[Mapping[str, Any]]) -> set[int]:
    return {int(r["step"]) for r in records if finite_number(r.get("collapse/tripped")) or r.get("collapse/alarm")}


def healthy_steps(records: Sequence[Mapping[str, Any]], steps: Iterable[int]) -> list[int]:
    """Checkpoint steps known to be healthy: iteration S (whose update made the weights) and iteration S + 1
    (whose rollouts those weights sampled) were both judged by the monitor (``collapse/tripped`` logged: an
    unmonitored iteration vouches for nothing), past its warm-up, and neither tripped a signal."""
    logged = {int(r["step"]) for r in records if "step" in r and "collapse/tripped" in r
              and not r.get("collapse/warmup")}
    tripped = tripped_iterations(records)
    return sorted(s for s in steps if {s, s + 1} <= logged and not {s, s + 1} & tripped)


def checkpoint_reward(records: Sequence[Mapping[str, Any]], step: int) -> float | None:
    """The training reward of a checkpoint's weights: iteration ``step + 1``'s reward (the rollouts those weights
    sampled), or iteration ``step``'s for the run's last checkpoint."""
    by_step = {int(r["step"]): r for r in records if "step" in r}
    for candidate in (step + 1, step):
        value = finite_number(by_step.get(candidate, {}).get(REWARD_KEY))
        if value is not None:
            return value
    return None


def monitored(records: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the collapse monitor judged any of a run's iterations (not with ``on_collapse=none``)."""
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
