"""``stppo_agent.algorithms.metrics``: loss metrics whose parts combine exactly over micro-batches and ranks, and
one optimizer step's metrics combined from them (StepMetrics), and an iteration's means over its steps (StepMeans)."""

from __future__ import annotations

import pytest
import torch

from stppo_agent.algorithms.metrics import (
    OFF_POLICY_KEYS,
    Extreme,
    LossMetrics,
    StepMeans,
    StepMetrics,
    Summed,
    ratio_of_sums,
)
from stppo_agent.distributed import process_group
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

def two_ranks(monkeypatch, others):
    """This process plays rank 0 of a world whose other ranks gathered ``others``."""
    monkeypatch.setattr(process_group, "world_size", lambda: 1 + len(others))
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: [local, *others])


def test_step_metrics_weight_plain_values_by_policy_tokens():
    step = StepMetrics()
    step.add({"pg_loss": torch.tensor(1.0)}, torch.tensor(2))
    step.add({"pg_loss": torch.tensor(4.0)}, torch.tensor(1))
    assert step.reduce() == {"pg_loss": pytest.approx(2.0)}


def test_step_metrics_add_sums_and_keep_extremes():
    def micro(total, count, high, low):
        m = LossMetrics()
        m.mean("clip_frac", torch.tensor(total), torch.tensor(count))
        m.extreme("ratio_max", torch.tensor(high), "max")
        m.extreme("ratio_min", torch.tensor(low), "min")
        m.summed("double", torch.tensor(0.0), torch.tensor([total, count]), lambda s: 2 * s[0] / s[1])
        return m

    step = StepMetrics()
    step.add(micro(1.0, 4.0, 1.5, 0.5), torch.tensor(4))
    step.add(micro(3.0, 4.0, 1.2, 0.8), torch.tensor(4))
    step.add(micro(0.0, 2.0, 2.5, 0.1), torch.tensor(2))
    out = step.reduce()
    assert list(out) == sorted(out)
    assert out == pytest.approx({"clip_frac": 0.4, "ratio_max": 2.5, "ratio_min": 0.1, "double": 0.8})


def test_step_metrics_combine_ranks_in_order(monkeypatch):
    # value_loss: a metric only the other rank reported (its finish: the ratio of the sums)
    other_sums = {"clip_frac": torch.tensor([3.0, 4.0], dtype=torch.float64),
                  "value_loss": torch.tensor([3.0, 2.0], dtype=torch.float64)}
    other_extremes = {"ratio_max": torch.tensor(9.0, dtype=torch.float64),
                      "ratio_min": torch.tensor(-1.0, dtype=torch.float64)}
    two_ranks(monkeypatch, [(other_sums, other_extremes, {"ratio_max": "max", "ratio_min": "min"})])
    m = LossMetrics()
    m.mean("clip_frac", torch.tensor(1.0), torch.tensor(2.0))
    m.extreme("ratio_max", torch.tensor(3.0), "max")
    m.extreme("ratio_min", torch.tensor(0.5), "min")
    step = StepMetrics()
    step.add(m, torch.tensor(2))
    assert step.reduce() == pytest.approx({"clip_frac": 4 / 6, "ratio_max": 9.0, "ratio_min": -1.0,
                                           "value_loss": 1.5})
    # the other way round: this rank holds the extremes
    two_ranks(monkeypatch, [({}, {"ratio_max": torch.tensor(1.0, dtype=torch.float64),
                                  "ratio_min": torch.tensor(2.0, dtype=torch.float64)},
                             {"ratio_max": "max", "ratio_min": "min"})])
    assert step.reduce() == pytest.approx({"clip_frac": 0.5, "ratio_max": 3.0, "ratio_min": 0.5})


def test_step_means_count_off_policy_steps_apart():
    means = StepMeans()
    means.add({"clip_frac": 0.0, "grad_norm": 1.0}, on_policy=True)
    means.add({"clip_frac": 0.2, "grad_norm": 3.0, "tail/ratio_max": 2.0}, on_policy=False)
    means.add({"clip_frac": 0.4, "grad_norm": 5.0}, on_policy=False)
    assert means.means() == pytest.approx({"clip_frac": 0.2, "grad_norm": 3.0, "tail/ratio_max": 2.0,
                                           "offpolicy/clip_frac": 0.3, "offpolicy/tail/ratio_max": 2.0,
                                           "offpolicy/steps": 2.0})
    only_on = StepMeans()
    only_on.add({"clip_frac": 0.1}, on_policy=True)
    assert only_on.means() == {"clip_frac": 0.1}
    assert "grad_norm" not in OFF_POLICY_KEYS and {"clip_bias_scale", "tail/turn_outside_frac"} <= set(OFF_POLICY_KEYS)
    assert {"dual_clip_frac", "ratio/ess", "clip_bias_changed"} <= set(OFF_POLICY_KEYS)
    assert len(OFF_POLICY_KEYS) == 14
