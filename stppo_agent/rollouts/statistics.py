"""A rollout batch's statistics over the *global* batch: what each rank contributes and the one collective that
combines the shares.

:func:`rollout_statistics` turns ``batch.stats`` (reward, response length, turns, answer / invalid / search-error
rates, ``advantage/*``, ``kl_to_reference``, ``rollout_correction/*``: this rank's share) into the statistics of the
whole batch, each share weighted by the size of the population it is a mean over. The rule for each statistic is
in :mod:`stppo_agent.algorithms.metrics`, the one place where every logged number's combination is defined; this
module takes a share's parts from a rollout batch (:func:`rollout_parts`). The shares are combined in rank order,
so every rank gets the same values: the collapse monitor, which runs on every rank and may decide a rollback,
then decides the same everywhere, and checkpoint selection (``@best``) reads the global reward.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stppo_agent.algorithms.losses import log_ratio_at_level
from stppo_agent.algorithms.metrics import combine_rollout_statistics
from stppo_agent.distributed import process_group


def rollout_statistics(batch, algo) -> dict[str, float]:
    """``batch.stats`` (this rank's share) as statistics of the global batch: the same dict on every rank (a
    collective). One process: ``batch.stats`` as it is. A statistic missing from a rank's share (no policy
    tokens there) counts with weight 0; one not in
    :data:`~stppo_agent.algorithms.metrics.ROLLOUT_STAT_POPULATIONS` is weighted by trajectories."""
    if process_group.world_size() == 1:
        return dict(batch.stats)
    return combine_rollout_statistics(process_group.all_gather_objects(rollout_parts(batch, algo)))


def rollout_parts(batch, algo) -> dict[str, Any]:
    """What :func:`combine_rollout_statistics` needs of one share: its statistics and population sizes (and the
    pre-cap rollout-correction weights, whose 99th percentile has no sums)."""
    stats = dict(batch.stats)
    trajectories = batch.batch_size
    parts = {"stats": stats, "trajectories": float(trajectories), "policy_tokens": float(batch.loss_mask.sum()),
             "turns": stats.get("turns", 0.0) * trajectories,
             "observations": stats.get("observations", 0.0) * trajectories}
    parts["searches"] = _search_attempts(stats, trajectories)
    if "rollout_correction/weight_p99" in stats and batch.old_logprobs is not None:
        parts["weights"] = rollout_weights(batch, algo.rollout_correction_level).cpu()
    return parts


def rollout_weights(batch, level: str) -> torch.Tensor:
    """The rollout-correction weights w = pi_old / pi_sample before the cap, one per policy token, exactly as
    :func:`~stppo_agent.algorithms.rollout_correction_weights` measures them."""
    mask = batch.loss_mask
    log_w = log_ratio_at_level(batch.old_logprobs.float(), batch.sample_logprobs.float(), mask, batch.turn_ids,
                               level)
    return torch.exp(log_w.clamp(-20.0, 20.0))[mask]


def _search_attempts(stats: Mapping[str, float], trajectories: int) -> float:
    """Searches attempted (served + failed), exactly from the per-trajectory means of both. Batches recorded
    before ``search_errors`` was a statistic hold only the served ones and the failed share e / (served + e),
    which gives e whenever the share is below 1; at 1 the turns that were neither invalid nor an answer bound it
    from above."""
    served = stats.get("search_calls", 0.0) * trajectories
    if "search_errors" in stats:
        return served + stats["search_errors"] * trajectories
    rate = stats.get("search_error_rate", 0.0)
    if rate < 1:
        return served / (1 - rate)
    turns = stats.get("turns", 0.0) * trajectories
    return max(1.0, turns * (1 - stats.get("invalid_action_rate", 0.0)) - stats.get("answer_rate", 0.0) * trajectories)
