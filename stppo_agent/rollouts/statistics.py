"""Every number the trainer logs, combined over micro-batches and data-parallel ranks in one place.

Each logged number is a mean (or a max, a quantile) over some population of the *global* batch -- trajectories,
turns, searches, policy tokens -- so it is combined as sums and counts over that population, never as a mean of
per-rank or per-micro-batch means:

- :class:`StepMetrics`: one optimizer step's loss metrics (``pg_loss``, ``entropy``, ``clip_frac``,
  ``turn_clip_frac``, ``value_loss``, ...), added up over the step's micro-batches from the parts a loss reports
  (:mod:`stppo_agent.algorithms.metrics`), then over ranks. The logged value does not depend on the micro-batch
  size or the number of processes.
- :func:`rollout_statistics`: a rollout batch's statistics (reward, response length, turns, answer / invalid /
  search-error rates, ``advantage/*``, ``kl_to_reference``, ``rollout_correction/*``), each rank's share
  weighted by the size of the population it is a mean over (:data:`ROLLOUT_STAT_POPULATIONS`).

Both gather every rank's parts with one collective and combine them in rank order, so every rank gets the same
values: the collapse monitor, which runs on every rank and may decide a rollback, then decides the same
everywhere, and checkpoint selection (``@best``) reads the global reward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from stppo_agent.algorithms.losses import log_ratio_at_level
from stppo_agent.algorithms.metrics import Extreme, Summed, ratio_of_sums
from stppo_agent.algorithms.segments import quantile
from stppo_agent.distributed import process_group


class StepMetrics:
    """Loss metrics of one optimizer step, accumulated over its micro-batches (:meth:`add`), then combined over
    ranks (:meth:`reduce`). A metric without parts (a registered loss's own) is a policy-token-weighted mean."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.finish: dict[str, Any] = {}
        self.extremes: dict[str, torch.Tensor] = {}
        self.ops: dict[str, str] = {}

    def add(self, metrics: Mapping[str, torch.Tensor], tokens: torch.Tensor) -> None:
        """``metrics`` of one micro-batch with ``tokens`` policy tokens."""
        parts = getattr(metrics, "parts", {})
        for name, value in metrics.items():
            part = parts.get(name)
            if part is None:
                weight = tokens.detach().double()
                part = Summed(torch.stack([torch.as_tensor(value).detach().double() * weight, weight]))
            if isinstance(part, Extreme):
                value = part.value.detach().double()
                if name in self.extremes:
                    pick = torch.maximum if part.op == "max" else torch.minimum
                    value = pick(self.extremes[name], value)
                self.extremes[name], self.ops[name] = value, part.op
            else:
                sums = part.sums.detach().double()
                self.sums[name] = self.sums[name] + sums if name in self.sums else sums
                self.finish[name] = part.finish

    def reduce(self) -> dict[str, float]:
        """The step's metrics over the whole global mini-batch (a collective: every rank calls it)."""
        local = ({k: v.cpu() for k, v in self.sums.items()}, {k: v.cpu() for k, v in self.extremes.items()},
                 dict(self.ops))
        everyone = process_group.all_gather_objects(local) if process_group.world_size() > 1 else [local]
        sums: dict[str, torch.Tensor] = {}
        extremes: dict[str, torch.Tensor] = {}
        ops: dict[str, str] = {}
        for rank_sums, rank_extremes, rank_ops in everyone:  # rank order: the same result on every rank
            for name, value in rank_sums.items():
                sums[name] = sums[name] + value if name in sums else value
            for name, value in rank_extremes.items():
                ops[name] = rank_ops[name]
                pick = torch.maximum if ops[name] == "max" else torch.minimum
                extremes[name] = pick(extremes[name], value) if name in extremes else value
        out = {name: float(self.finish.get(name, ratio_of_sums)(value)) for name, value in sums.items()}
        out.update({name: float(value) for name, value in extremes.items()})
        return dict(sorted(out.items()))


# What each rollout statistic is a mean over. "max" and "p99" are combined as such; "pooled_std" from the
# ranks' means, standard deviations and policy-token counts.
ROLLOUT_STAT_POPULATIONS = {
    "reward": "trajectories",
    "response_tokens": "trajectories",
    "turns": "trajectories",
    "search_calls": "trajectories",
    "search_errors": "trajectories",
    "answer_rate": "trajectories",
    "truncated_max_total_tokens": "trajectories",
    "observations": "trajectories",
    "observation_cut_rate": "observations",
    "invalid_action_rate": "turns",
    "search_error_rate": "searches",
    "advantage/mean": "policy_tokens",
    "advantage/std": "pooled_std",
    "kl_to_reference": "policy_tokens",
    "rollout_logprob_diff": "policy_tokens",
    "rollout_correction/kl": "policy_tokens",
    "rollout_correction/weight_mean": "policy_tokens",
    "rollout_correction/truncated_frac": "policy_tokens",
    "rollout_correction/masked_frac": "policy_tokens",
    "rollout_correction/weight_max": "max",
    "rollout_correction/weight_p99": "p99",
}


def rollout_statistics(batch, algo) -> dict[str, float]:
    """``batch.stats`` (this rank's share) as statistics of the global batch: the same dict on every rank (a
    collective). One process: ``batch.stats`` as it is. A statistic missing from a rank's share (no policy
    tokens there) counts with weight 0; one not in :data:`ROLLOUT_STAT_POPULATIONS` is weighted by
    trajectories."""
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


def combine_rollout_statistics(shares: list[dict[str, Any]]) -> dict[str, float]:
    """The statistics of the batch made of ``shares`` (each from :func:`rollout_parts`)."""
    names = sorted({name for share in shares for name in share["stats"]})
    out: dict[str, float] = {}
    for name in names:
        population = ROLLOUT_STAT_POPULATIONS.get(name, "trajectories")
        present = [share for share in shares if name in share["stats"]]
        if population == "max":
            out[name] = max(share["stats"][name] for share in present)
        elif population == "p99":
            values = [share["weights"] for share in present if "weights" in share]
            out[name] = quantile(torch.cat(values), 0.99) if values else max(s["stats"][name] for s in present)
        elif population == "pooled_std":
            out[name] = _pooled_std(present)
        else:
            weight = sum(share[population] for share in present)
            total = sum(share["stats"][name] * share[population] for share in present)
            out[name] = total / weight if weight > 0 else 0.0
    return out


def _pooled_std(shares: list[dict[str, Any]]) -> float:
    """The unbiased standard deviation of the advantages over all policy tokens, from each share's mean, unbiased
    standard deviation and count (sum of squares = (n - 1) s^2 + n m^2)."""
    count = sum(share["policy_tokens"] for share in shares)
    if count <= 1:
        return 0.0
    total = sum(share["stats"].get("advantage/mean", 0.0) * share["policy_tokens"] for share in shares)
    squares = sum(max(share["policy_tokens"] - 1, 0.0) * share["stats"]["advantage/std"] ** 2
                  + share["policy_tokens"] * share["stats"].get("advantage/mean", 0.0) ** 2 for share in shares)
    return math.sqrt(max(squares - total**2 / count, 0.0) / (count - 1))
