"""Rates over finished episodes, shared by training rollouts and evaluation so both report the same thing."""

from __future__ import annotations

from typing import Mapping, Sequence


def episode_rates(episodes: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """``answer_rate`` (episodes that ended in an answer), ``invalid_action_rate`` (per turn) and
    ``search_error_rate`` (per attempted search), from per-episode counters ``turns``, ``invalid_actions``,
    ``search_calls``, ``search_errors`` and ``answered``."""
    turns = sum(e["turns"] for e in episodes)
    searches = sum(e["search_calls"] + e["search_errors"] for e in episodes)
    return {
        "answer_rate": sum(bool(e["answered"]) for e in episodes) / max(1, len(episodes)),
        "invalid_action_rate": sum(e["invalid_actions"] for e in episodes) / max(1, turns),
        "search_error_rate": sum(e["search_errors"] for e in episodes) / max(1, searches),
    }
