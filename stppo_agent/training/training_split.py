"""Training reads the benchmarks' train split unless ``env_kwargs.split`` names another.

A search env on its own serves its benchmark's evaluation split (``test``; dev for some), which is right for
``stppo eval`` and ``gym.make`` but wrong for a trainer: ``stppo train --env stppo/NQ-v0`` trained on NQ's test
questions and a later eval on them scored a policy on what it had learned from. Search-R1, verl and TRL all train
on a train file; ``stppo sft`` and ``stppo export verl`` already default to ``--split train``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from stppo_agent.rollouts.envs import is_search_env

TRAINING_SPLIT = "train"


def with_training_split(config, previous: Mapping[str, Any] | None,
                        report: Callable[[str], None] = print):
    """``config`` with ``env_kwargs.split = "train"`` where every env is a search env and no split is given.

    ``previous``: the config of the checkpoint being resumed (None for a new run). A run that started before this
    default, with no split, resumes on the split it started with (the checkpoint's prompt position indexes its
    examples), with a warning."""
    if "split" in config.env_kwargs:
        return config
    ids = [e.strip() for e in config.env.split(",") if e.strip()]
    if not ids or not all(is_search_env(env_id) for env_id in ids):
        return config
    if previous is not None and "split" not in (previous.get("env_kwargs") or {}):
        report(f"warning: this run started without env_kwargs.split, so it trains on {config.env}'s evaluation "
               f"split (test or dev) and resumes there; a new run trains on the {TRAINING_SPLIT} split by default")
        return config
    return dataclasses.replace(config, env_kwargs={**config.env_kwargs, "split": TRAINING_SPLIT})
