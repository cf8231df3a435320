"""``stppo_agent.algorithms.metrics``: loss metrics whose parts combine exactly over
micro-batches and ranks."""

from __future__ import annotations

import pytest
import torch

from stppo_agent.algorithms.metrics import Extreme, LossMetrics, Summed, ratio_of_sums
from tests.support.batches import F64, t64


def test_loss_metrics_parts_combine_exactly():
    metrics = LossMetrics({"plain": torch.tensor(1.0)}, other=torch.tensor(2.0))
    assert metrics.parts == {} and metrics["plain"].item() == 1.0 and metrics["other"].item() == 2.0
    metrics.mean("one", t64(3.0), torch.tensor(1))
    assert metrics["one"].item() == 3.0
    metrics.mean("m", t64(3.0), torch.tensor(4))
    assert metrics["m"].item() == 0.75 and metrics.parts["m"].sums.tolist() == [3.0, 4.0]
    assert metrics.parts["m"].sums.dtype == F64 and metrics.parts["m"].finish is ratio_of_sums
    metrics.mean("empty", t64(0.0), torch.tensor(0))
    assert metrics["empty"].item() == 0.0
    metrics.mean("scaled", t64(3.0), torch.tensor(4), value=t64(0.25))
    assert metrics["scaled"].item() == 0.25 and metrics.parts["scaled"].sums.tolist() == [3.0, 4.0]
    grad = t64(2.0).requires_grad_(True)
    metrics.mean("detached", grad * 2, torch.tensor(1))
    assert not metrics["detached"].requires_grad and not metrics.parts["detached"].sums.requires_grad
    metrics.summed("s", grad * 1, grad.expand(3) * 1, lambda sums: sums.sum())
    assert not metrics["s"].requires_grad and metrics.parts["s"].finish(metrics.parts["s"].sums).item() == 6.0
    metrics.extreme("low", grad * 1, "min")
    assert isinstance(metrics.parts["low"], Extreme) and metrics.parts["low"].op == "min"
    assert not metrics.parts["low"].value.requires_grad
    assert Extreme(torch.tensor(1.0)).op == "max"
    with pytest.raises(ValueError, match=r"^Extreme op must be one of \('max', 'min'\), got 'mean'$"):
        Extreme(torch.tensor(1.0), "mean")
    assert Summed(t64([6.0, 3.0])).finish(t64([6.0, 3.0])).item() == 2.0
    assert ratio_of_sums(t64([6.0, 0.0])).item() == 6.0
