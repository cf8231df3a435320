"""``stppo_agent.algorithms.clip_bias``: the clipping-bias corrector of S-PPO / ST-PPO --
what it accumulates over micro-batches, its scale max(1, ||C|| / kappa), its data-parallel branches (with the
collectives faked, so they run in one process), measuring without correcting, and the device it works on."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from stppo_agent.algorithms import clip_bias as clip_bias_module
from stppo_agent.algorithms.clip_bias import ClipBiasCorrector
from tests.support.batches import F64, t64

# --- clip_bias: ClipBiasCorrector ---------------------------------------------------------------------------

def _params():
    """Two trainable parameters of different shapes and a frozen one."""
    a = torch.nn.Parameter(t64([1.0, 2.0, 3.0]))
    b = torch.nn.Parameter(t64([[1.0, -1.0], [0.5, 2.0]]))
    frozen = torch.nn.Parameter(t64([5.0]), requires_grad=False)
    return a, b, frozen


def test_clip_bias_corrector_keeps_only_trainable_parameters_and_its_defaults():
    a, b, frozen = _params()
    corrector = ClipBiasCorrector([a, frozen, b])
    assert corrector.parameters == [a, b]
    assert corrector.kappa == 1.0 and corrector.through_grad is False and corrector.rescale is True
    with pytest.raises(ValueError, match=r"^kappa must be > 0, got 0.0$"):
        ClipBiasCorrector([a], kappa=0.0)
    with pytest.raises(ValueError, match="kappa must be > 0"):
        ClipBiasCorrector([a], kappa=-1.0)
    assert ClipBiasCorrector([a], kappa=1e-9).kappa == 1e-9


def test_clip_bias_accumulates_c_over_micro_batches_and_keeps_the_graph_for_the_loss():
    a, b, _ = _params()
    corrector = ClipBiasCorrector([a, b], kappa=100.0)
    hidden = a * 2.0  # a shared graph: the loss backward must still work after the corrector's
    corrector.accumulate((hidden * t64([1.0, 0.0, 0.0])).sum())  # C_a += [2, 0, 0]; b unused: no gradient
    corrector.accumulate((hidden * t64([0.0, 1.0, 0.0])).sum() + (b * t64([[1.0, 0.0], [0.0, 0.0]])).sum())
    assert a.grad is None and b.grad is None  # .grad is left as it was
    torch.testing.assert_close(corrector._bias[0], t64([2.0, 2.0, 0.0]))
    torch.testing.assert_close(corrector._bias[1], t64([[1.0, 0.0], [0.0, 0.0]]))
    hidden.sum().backward()  # the loss backward through the retained graph
    torch.testing.assert_close(a.grad, t64([2.0, 2.0, 2.0]))
    corrector.accumulate(torch.tensor(3.0, dtype=F64))  # nothing clipped: no gradient, nothing added
    torch.testing.assert_close(corrector._bias[0], t64([2.0, 2.0, 0.0]))


def test_clip_bias_nothing_clipped_leaves_c_empty_and_the_gradient_unscaled():
    a, b, _ = _params()
    corrector = ClipBiasCorrector([a, b], kappa=0.5)
    corrector.accumulate(torch.tensor(1.0, dtype=F64))
    assert corrector._bias is None
    a.grad, b.grad = t64([3.0, 0.0, 4.0]), None  # b has no gradient: left out of the norm and the scaling
    metrics = corrector.apply()
    assert metrics["clip_bias_norm"].item() == 0.0
    assert metrics["pg_grad_norm"].item() == pytest.approx(5.0)
    assert metrics["clip_bias_scale"].item() == 1.0
    torch.testing.assert_close(a.grad, t64([3.0, 0.0, 4.0]))
    assert b.grad is None


@pytest.mark.parametrize("kappa, scale", [(1.0, 5.0), (2.0, 2.5), (5.0, 1.0), (10.0, 1.0)])
def test_clip_bias_scale_is_the_bias_norm_over_kappa_never_below_one(kappa, scale):
    a, b, _ = _params()
    corrector = ClipBiasCorrector([a, b], kappa=kappa)
    corrector.accumulate((a * t64([3.0, 0.0, 0.0])).sum() + (b * t64([[0.0, 4.0], [0.0, 0.0]])).sum())  # ||C|| 5
    a.grad, b.grad = t64([2.0, 0.0, 0.0]), t64([[0.0, 0.0], [0.0, 10.0]])
    metrics = corrector.apply()
    assert metrics["clip_bias_norm"].item() == pytest.approx(5.0)
    assert metrics["pg_grad_norm"].item() == pytest.approx(math.sqrt(104.0))  # measured before the scaling
    assert metrics["clip_bias_scale"].item() == pytest.approx(scale)
    torch.testing.assert_close(a.grad, t64([2.0, 0.0, 0.0]) / scale)
    torch.testing.assert_close(b.grad, t64([[0.0, 0.0], [0.0, 10.0]]) / scale)
    assert corrector._bias is None  # reset: the next step measures afresh
    a.grad = t64([1.0, 1.0, 1.0])
    b.grad = None
    again = corrector.apply()
    assert again["clip_bias_norm"].item() == 0.0 and again["clip_bias_scale"].item() == 1.0


def test_clip_bias_without_parameters_reports_zero_norms():
    metrics = ClipBiasCorrector([]).apply()
    assert metrics["clip_bias_norm"].item() == 0.0 and metrics["pg_grad_norm"].item() == 0.0
    assert metrics["clip_bias_scale"].item() == 1.0


def test_clip_bias_through_grad_takes_c_from_a_second_backward_and_restores_the_loss_gradient():
    a, b, _ = _params()
    corrector = ClipBiasCorrector([a, b], kappa=1.0, through_grad=True)
    a.grad = t64([1.0, 1.0, 1.0])  # the loss gradient of earlier micro-batches
    hidden = a * 3.0
    corrector.accumulate((hidden * t64([0.0, 1.0, 0.0])).sum())
    torch.testing.assert_close(a.grad, t64([1.0, 1.0, 1.0]))
    (hidden.sum() * 0.0).backward()  # the graph is kept for the loss backward
    assert b.grad is None  # it had none and takes no share of C
    corrector.accumulate((a * t64([0.0, 1.0, 0.0])).sum() + (b * t64([[0.0, 0.0], [4.0, 0.0]])).sum())
    torch.testing.assert_close(corrector._bias[0], t64([0.0, 4.0, 0.0]))
    torch.testing.assert_close(corrector._bias[1], t64([[0.0, 0.0], [4.0, 0.0]]))
    assert b.grad is None
    b.grad = t64([[0.0, 0.0], [0.0, 0.0]])
    corrector.all_reduce()  # FSDP2 has averaged C: a no-op
    metrics = corrector.apply()
    assert metrics["clip_bias_norm"].item() == pytest.approx(math.sqrt(32.0))
    torch.testing.assert_close(a.grad, t64([1.0, 1.0, 1.0]) / math.sqrt(32.0))


def test_clip_bias_through_grad_joins_the_collective_backward_when_another_rank_clipped(monkeypatch):
    """A rank with nothing clipped still back-propagates (zero, through its anchor) when any rank clipped; with
    no rank clipped nobody does. The count of clipping ranks is a sum over ranks of 1.0 / 0.0."""
    sent = []

    def other_rank_clipped(value):
        sent.append(float(value))
        return value + 1.0

    monkeypatch.setattr(clip_bias_module, "all_reduce_sum", other_rank_clipped)
    a, b, _ = _params()
    corrector = ClipBiasCorrector([a, b], through_grad=True)
    a.grad = t64([1.0, 2.0, 3.0])
    unclipped = torch.tensor(0.0, dtype=F64)
    with pytest.raises(ValueError, match="^through_grad needs an anchor tensor for ranks with nothing clipped$"):
        corrector.accumulate(unclipped)
    anchor = a * 2.0
    corrector.accumulate(unclipped, anchor=anchor)
    assert sent == [0.0, 0.0]
    assert corrector._bias is not None
    torch.testing.assert_close(corrector._bias[0], torch.zeros(3, dtype=F64))
    torch.testing.assert_close(a.grad, t64([1.0, 2.0, 3.0]))  # the loss gradient is back
    corrector.accumulate((a * t64([1.0, 0.0, 0.0])).sum())
    assert sent[-1] == 1.0
    torch.testing.assert_close(corrector._bias[0], t64([1.0, 0.0, 0.0]))

    monkeypatch.setattr(clip_bias_module, "all_reduce_sum", lambda value: value * 0.0)  # nobody clipped
    alone = ClipBiasCorrector([a, b], through_grad=True)
    alone.accumulate(unclipped)  # no anchor needed: no backward at all
    assert alone._bias is None
    torch.testing.assert_close(a.grad, t64([1.0, 2.0, 3.0]))


def _fake_two_ranks(monkeypatch, other_flat):
    """torch.distributed as two ranks whose all_reduce adds ``other_flat`` (the other rank's C); the default
    group would be of 3 ranks, so the group given must be the one asked."""
    calls = []

    def all_reduce(tensor, op=None, group=None):
        calls.append((op, group, tensor.clone()))
        tensor.add_(other_flat)

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3 if group is None else 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls


def test_clip_bias_all_reduce_averages_c_over_ranks_as_ddp_averages_gradients(monkeypatch):
    a, b, _ = _params()
    c = torch.nn.Parameter(t64([0.0, 0.0]))
    other = t64([1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 6.0, 8.0])  # the other rank's C, flattened: a, b, c
    calls = _fake_two_ranks(monkeypatch, other)
    corrector = ClipBiasCorrector([a, b, c])
    corrector.accumulate((a * t64([3.0, 0.0, 1.0])).sum() + (b * t64([[0.0, 2.0], [0.0, 4.0]])).sum()
                         + (c * t64([2.0, 0.0])).sum())
    corrector.all_reduce(group="g")
    assert len(calls) == 1  # one collective for every tensor
    op, group, sent = calls[0]
    assert op == dist.ReduceOp.SUM and group == "g"
    torch.testing.assert_close(sent, t64([3.0, 0.0, 1.0, 0.0, 2.0, 0.0, 4.0, 2.0, 0.0]))
    torch.testing.assert_close(corrector._bias[0], t64([2.0, 0.5, 1.0]))
    torch.testing.assert_close(corrector._bias[1], t64([[1.0, 2.0], [1.0, 3.0]]))
    torch.testing.assert_close(corrector._bias[2], t64([4.0, 4.0]))


def test_clip_bias_all_reduce_joins_with_zeros_when_this_rank_clipped_nothing(monkeypatch):
    a, b, _ = _params()
    calls = _fake_two_ranks(monkeypatch, t64([2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0]))
    corrector = ClipBiasCorrector([a, b])
    corrector.all_reduce(group="h")
    torch.testing.assert_close(calls[0][2], torch.zeros(7, dtype=F64))
    torch.testing.assert_close(corrector._bias[0], t64([1.0, 0.0, 0.0]))
    torch.testing.assert_close(corrector._bias[1], t64([[0.0, 0.0], [0.0, 2.0]]))
    assert ClipBiasCorrector([a, b], through_grad=True).all_reduce() is None and len(calls) == 1


def test_clip_bias_all_reduce_is_a_no_op_without_a_process_group():
    a = torch.nn.Parameter(t64([1.0, 2.0]))
    corrector = ClipBiasCorrector([a], kappa=2.0)
    corrector.accumulate((a * t64([0.0, 4.0])).sum())
    corrector.all_reduce()  # torch.distributed is available but not initialised here
    torch.testing.assert_close(corrector._bias[0], t64([0.0, 4.0]))
    a.grad = t64([6.0, 8.0])
    metrics = corrector.apply()  # one parameter: its device is the norms'
    assert metrics["clip_bias_scale"].item() == 2.0
    torch.testing.assert_close(a.grad, t64([3.0, 4.0]))


def test_clip_bias_measuring_only_returns_the_two_norms_and_leaves_the_gradient():
    a, b, _ = _params()
    corrector = ClipBiasCorrector([a, b], kappa=0.1, rescale=False)
    corrector.accumulate((b * t64([[0.0, 0.0], [3.0, 4.0]])).sum())
    a.grad, b.grad = t64([1.0, 0.0, 0.0]), None
    metrics = corrector.apply()
    assert set(metrics) == {"clip_bias_norm", "pg_grad_norm"}
    assert metrics["clip_bias_norm"].item() == pytest.approx(5.0) and metrics["pg_grad_norm"].item() == 1.0
    torch.testing.assert_close(a.grad, t64([1.0, 0.0, 0.0]))
    assert corrector._bias is None


def _bias_step(corrector, theta, weights):
    """One step of a corrector on a toy surrogate: C = grad (weights . theta), loss gradient = theta."""
    corrector.accumulate((weights * theta).sum())
    theta.grad = theta.detach().clone()
    return corrector.apply()


def test_a_corrector_reused_over_steps_measures_each_step_afresh():
    from stppo_agent.algorithms.clip_bias import ClipBiasCorrector

    theta = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    corrector = ClipBiasCorrector([theta], kappa=1.0)
    first = _bias_step(corrector, theta, torch.tensor([6.0, 8.0], dtype=torch.float64))
    second = _bias_step(corrector, theta, torch.tensor([0.0, 2.0], dtype=torch.float64))
    assert first["clip_bias_norm"].item() == pytest.approx(10.0)
    assert second["clip_bias_norm"].item() == pytest.approx(2.0)  # step 2's C alone, not 0 nor step 1's + 2's
    torch.testing.assert_close(theta.grad, theta.detach() / 2.0)


def test_measuring_only_reports_the_norms_and_leaves_the_gradient_alone():
    from stppo_agent.algorithms.clip_bias import ClipBiasCorrector

    theta = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    metrics = _bias_step(ClipBiasCorrector([theta], kappa=1.0, rescale=False), theta,
                         torch.tensor([6.0, 8.0], dtype=torch.float64))
    assert set(metrics) == {"clip_bias_norm", "pg_grad_norm"}
    assert metrics["clip_bias_norm"].item() == pytest.approx(10.0)
    assert metrics["pg_grad_norm"].item() == pytest.approx(5.0)
    torch.testing.assert_close(theta.grad, theta.detach())


def test_clip_bias_apply_and_accumulate_stay_on_the_parameters_device():
    from stppo_agent.algorithms.clip_bias import ClipBiasCorrector

    a = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=F64))
    a.grad = torch.tensor([6.0, 8.0], dtype=F64)
    unclipped = torch.tensor(1.0, dtype=F64)  # no grad: nothing clipped on this rank
    with torch.device("meta"):
        ClipBiasCorrector([a], through_grad=True).accumulate(unclipped)
        metrics = ClipBiasCorrector([a], kappa=0.5).apply()  # nothing accumulated: ||C|| = 0, scale 1
        empty = ClipBiasCorrector([]).apply()
    assert metrics["clip_bias_norm"].device.type == "cpu" and float(metrics["clip_bias_norm"]) == 0.0
    assert float(metrics["pg_grad_norm"]) == 10.0 and float(metrics["clip_bias_scale"]) == 1.0
    assert a.grad.tolist() == [6.0, 8.0]
    assert all(value.device.type == "cpu" for value in empty.values())


def test_clip_bias_apply_reports_an_empty_bias_norm_on_the_parameters_device():
    from stppo_agent.algorithms.clip_bias import ClipBiasCorrector

    a = torch.nn.Parameter(torch.ones(3, device="meta"))
    a.grad = torch.ones(3, device="meta")
    metrics = ClipBiasCorrector([a]).apply()  # nothing accumulated: ||C|| is a created zero
    assert {name: value.device.type for name, value in metrics.items()} == {
        "clip_bias_norm": "meta", "pg_grad_norm": "meta", "clip_bias_scale": "meta"}
