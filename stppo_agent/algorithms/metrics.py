"""Loss metrics that combine exactly over micro-batches and data-parallel ranks.

A metric such as ``clip_frac`` is a mean over some population of the batch: policy tokens for ``clip_frac``,
(trajectory, turn) segments for ``turn_clip_frac``, trajectories for a ``seq-mean-token-mean`` loss. Averaging
per-micro-batch values weighted by anything but that population's size (a fraction of turns weighted by tokens)
makes the logged number depend on the micro-batch size and on the number of processes. So a loss returns a
:class:`LossMetrics`: the usual ``{name: detached tensor}`` of the values over the batch it was given -- what a
single call reports, unchanged -- plus ``parts[name]``, what the trainer must add up to get the value over the
whole optimizer batch:

- :class:`Summed`: a few sums (a mean is ``(total, count)``); they add over micro-batches and ranks, then
  ``finish`` turns the added sums into the value. Exact for every split.
- :class:`Extreme`: a max or a min, combined with max / min.

A metric without parts (a registered loss of one's own) is combined as a policy-token-weighted mean, which is
exact for per-token means.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

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
