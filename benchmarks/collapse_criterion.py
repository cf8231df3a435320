"""The stress benchmark's collapse criterion, stated once: :data:`CRITERION` is the text the report and
docs/stability.md quote, :func:`judge` is what applies it.

It judges a run's *read-outs*: the learner probe's rewards when the run has them (``probe/reward``, the current
actor: stppo_agent/training/probe.py), else its version-aligned rollout rewards (benchmarks/stress_readout.py picks
them). A drop must persist to count: a dip that recovers is counted apart, as ``dipped``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

WINDOW = 3  # read-outs in the trailing moving average
PERSIST = 2  # consecutive read-outs below the line that make a collapse
DRAWDOWN = 0.5  # the line: this share of the running best of the moving average
MIN_BEST = 0.1  # a best below this is noise, not something to lose
INVALID_FLOOR = 0.5  # the invalid-action line: above both this and twice the first read-out's rate

CRITERION = (
    f"on the run's read-outs (the learner probe's rewards when the run has probes, else its version-aligned rollout "
    f"rewards), a run collapsed if the {WINDOW}-point moving average of its reward stayed below {DRAWDOWN:g} x its "
    f"running best (the best of its full {WINDOW}-point averages, at least {MIN_BEST:g}) for {PERSIST} or more "
    f"consecutive read-outs, or was below it at the final read-out; where the env counts invalid actions, "
    f"likewise when the {WINDOW}-point moving average of the invalid-action rate stayed above both "
    f"{INVALID_FLOOR:g} and twice the first read-out's (reward-only where the env does not count them: "
    f"stppo/Toy-v0); an update skipped for NaN/inf is a collapse. A run that went below the line and came back "
    f"(fewer than {PERSIST} consecutive read-outs, not at the end) dipped: counted apart, not as a collapse")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """``collapsed_at``: the label (policy version) of the first read-out of the drop that stayed, or of the first
    NaN-skipped update; ``reason``: reward, invalid or nan_skip; ``dips``: (first, last) labels of drops that
    recovered; ``dipped``: it had such a drop and did not collapse (the two counts are apart)."""

    collapsed: bool
    collapsed_at: float | None
    reason: str | None
    dipped: bool
    dips: tuple[tuple[float, float], ...]
    readouts: int


def moving_average(values: Sequence[float], window: int = WINDOW) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def running_best(rewards: Sequence[float]) -> list[float]:
    """Per read-out, the best of the moving averages so far, counted from the first full window on (-inf before
    it): a moving average of one lucky probe is not a level the policy ever held, and a best set by it turned
    ordinary probe noise into dips. A run shorter than the window counts every read-out."""
    best, out = float("-inf"), []
    for i, value in enumerate(moving_average(rewards)):
        if i >= WINDOW - 1 or len(rewards) < WINDOW:
            best = max(best, value)
        out.append(best)
    return out


def line_at_end(rewards: Sequence[float]) -> float | None:
    """The reward line of the criterion at the final read-out (DRAWDOWN x the running best): what a run would have
    had to fall below. Beside the tier's chance reward it says what a 0-collapse bound covers: a line at or under
    chance cannot see a fall back to a random policy."""
    best = running_best(rewards)[-1] if rewards else float("-inf")
    return DRAWDOWN * best if best > float("-inf") else None


def below_the_line(rewards: Sequence[float], invalid: Sequence[float] | None = None) -> list[str | None]:
    """Per read-out, why it is below the line (``reward`` / ``invalid``) or None."""
    smooth, out = moving_average(rewards), []
    smooth_invalid = moving_average(invalid) if invalid is not None else None
    for i, (value, best) in enumerate(zip(smooth, running_best(rewards))):
        if best >= MIN_BEST and value < DRAWDOWN * best:
            out.append("reward")
        elif smooth_invalid is not None and smooth_invalid[i] > max(INVALID_FLOOR, 2 * invalid[0]):
            out.append("invalid")
        else:
            out.append(None)
    return out


def judge(labels: Sequence[float], rewards: Sequence[float], invalid: Sequence[float] | None = None,
          skipped_at: Sequence[float] = ()) -> Verdict:
    """The :data:`CRITERION` verdict on read-outs ``rewards`` at ``labels`` (policy versions, increasing);
    ``invalid``: their invalid-action rates where the env counts invalid actions, else None; ``skipped_at``: the
    policy versions of updates skipped for NaN/inf."""
    if len(labels) != len(rewards) or (invalid is not None and len(invalid) != len(rewards)):
        raise ValueError("labels, rewards and invalid must be read-outs of the same length")
    marks = below_the_line(rewards, invalid)
    collapsed_at, reason, dips, i = None, None, [], 0
    while i < len(marks):
        if marks[i] is None:
            i += 1
            continue
        end = i
        while end + 1 < len(marks) and marks[end + 1] is not None:
            end += 1
        if end - i + 1 >= PERSIST or end == len(marks) - 1:
            collapsed_at, reason = labels[i], marks[i]
            break
        dips.append((labels[i], labels[end]))
        i = end + 1
    if skipped_at and (collapsed_at is None or min(skipped_at) < collapsed_at):
        collapsed_at, reason = min(skipped_at), "nan_skip"
    collapsed = collapsed_at is not None
    return Verdict(collapsed, collapsed_at, reason, bool(dips) and not collapsed, tuple(dips), len(rewards))
