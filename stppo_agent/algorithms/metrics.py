"""Every number the trainer logs, combined over micro-batches, data-parallel ranks and optimizer steps: the one
place where those rules live.

Each logged number is a mean (or a max, a quantile) over some population of the *global* batch -- policy tokens for
``clip_frac``, (trajectory, turn) segments for ``turn_clip_frac``, trajectories for a ``seq-mean-token-mean`` loss
or for ``reward`` -- so it is combined as sums and counts over that population, never as a mean of per-rank or
per-micro-batch means: weighting a fraction of turns by tokens makes the logged number depend on the micro-batch
size and on the number of processes.

- A loss returns :class:`LossMetrics`: the usual ``{name: detached tensor}`` of the values over the batch it was
  given -- what a single call reports, unchanged -- plus ``parts[name]``, what must be added up to get the value
  over the whole optimizer batch: :class:`Summed` (a few sums; a mean is ``(total, count)``; they add over
  micro-batches and ranks, then ``finish`` turns them into the value, exact for every split) or :class:`Extreme`
  (a max or a min). A metric without parts (a registered loss of one's own) is combined as a
  policy-token-weighted mean, exact for per-token means.
- :class:`StepMetrics`: one optimizer step's loss metrics, added up over its micro-batches, then over ranks.
- :class:`StepMeans`: the iteration's means over its optimizer steps, and over its off-policy steps alone.
- :func:`combine_rollout_statistics`: a rollout batch's statistics from every rank's share, each weighted by the
  population in :data:`ROLLOUT_STAT_POPULATIONS` (the shares come from :mod:`stppo_agent.rollouts.statistics`).

Ranks' parts are gathered with one collective and combined in rank order, so every rank gets the same values.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Callable

import torch

from stppo_agent.distributed import process_group

from .segments import quantile

EXTREME_OPS = ("max", "min")


def ratio_of_sums(sums: torch.Tensor) -> torch.Tensor:
    """``total / count`` (0 when the population is empty)."""
    return sums[0] / sums[1].clamp(min=1)


@dataclasses.dataclass(frozen=True)
class Summed:
    """``sums`` (1-D) add over micro-batches and ranks; ``finish(added sums)`` is the metric's value."""

    sums: torch.Tensor
    finish: Callable[[torch.Tensor], torch.Tensor] = ratio_of_sums


@dataclasses.dataclass(frozen=True)
class Extreme:
    """A max (``op="max"``) or min over the batch: combined with the same op."""

    value: torch.Tensor
    op: str = "max"

    def __post_init__(self):
        if self.op not in EXTREME_OPS:
            raise ValueError(f"Extreme op must be one of {EXTREME_OPS}, got {self.op!r}")


class LossMetrics(dict):
    """``{name: detached tensor}`` (the values over this call's batch) with ``parts[name]``: how each combines
    over micro-batches and ranks (:class:`Summed` or :class:`Extreme`). Adding keys the plain dict way (a wrapper
    around a built-in loss) keeps working: such keys have no parts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parts: dict[str, Summed | Extreme] = {}

    def mean(self, name: str, total: torch.Tensor, count: torch.Tensor, value: torch.Tensor | None = None) -> None:
        """A mean over a population of ``count`` members whose values sum to ``total``. ``value``: what this call
        reports, when it is not ``total / count`` (a loss normalised by a global count)."""
        total = total.detach()
        count = count.detach().to(total.dtype)
        self[name] = (value if value is not None else total / count.clamp(min=1)).detach()
        self.parts[name] = Summed(torch.stack([total, count]))

    def summed(self, name: str, value: torch.Tensor, sums: torch.Tensor,
               finish: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self[name] = value.detach()
        self.parts[name] = Summed(sums.detach(), finish)

    def extreme(self, name: str, value: torch.Tensor, op: str) -> None:
        self[name] = value.detach()
        self.parts[name] = Extreme(value.detach(), op)


def effective_sample_size(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """(value, sums, finish) of the normalised effective sample size of importance ``weights`` (1-D, one per
    sample): (sum w)^2 / (n sum w^2), 1 when every weight is equal (on-policy), 1/n when one sample carries all
    the weight, 1 for no samples. The sums (in float64) add over micro-batches and ranks."""
    w = weights.detach().double()
    sums = torch.stack([w.sum(), (w * w).sum(), torch.tensor(float(w.numel()), dtype=w.dtype, device=w.device)])
    return _ess_from_sums(sums).to(weights.dtype), sums, _ess_from_sums


def _ess_from_sums(sums: torch.Tensor) -> torch.Tensor:
    total, squares, count = sums
    defined = (count > 0) & (squares > 0)
    return torch.where(defined, total * total / (count * squares).clamp(min=1e-300), torch.ones_like(total))


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


OFF_POLICY_KEYS = ("clip_frac", "turn_clip_frac", "dual_clip_frac", "ratio/ess", "clip_bias_scale", "clip_bias_norm",
                   "clip_bias_changed", "grad_cos_to_first", "tail/ratio_max", "tail/ratio_p99", "tail/turn_ratio_max",
                   "tail/turn_ratio_p99", "tail/token_outside_frac", "tail/turn_outside_frac")


class StepMeans:
    """Means over an iteration's optimizer steps of every metric, plus ``offpolicy/K`` for the keys that tell
    whether clipping and the correction acted (means over the off-policy steps; absent when there were none)."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, metrics: dict[str, float], on_policy: bool, applied: bool = True) -> None:
        """One optimizer step's metrics; ``applied`` False: the actor's step was skipped (non-finite), so it is no
        off-policy step the actor took."""
        for key, value in metrics.items():
            self._add(key, value)
            if not on_policy and key in OFF_POLICY_KEYS:
                self._add(f"offpolicy/{key}", value)
        if not on_policy and applied:
            self._add("offpolicy/steps", 1.0)

    def _add(self, key: str, value: float) -> None:
        self.sums[key] += value
        self.counts[key] += 1

    def means(self) -> dict[str, float]:
        out = {key: self.sums[key] / self.counts[key] for key in self.sums}
        if "offpolicy/steps" in self.sums:
            out["offpolicy/steps"] = self.sums["offpolicy/steps"]  # a count, not a mean
        return out


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
