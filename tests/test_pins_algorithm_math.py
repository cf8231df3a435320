"""Pins of the algorithms' math (issue 27, slice F): small hand-made batches whose every value, boundary and
direction is fixed by docs/algorithms.md -- the clipping-bias corrector (with the collectives faked, so the
data-parallel branches run in one process), the segment reductions, the advantage estimators, the losses and the
stabilisers' metrics. Fast: no model, no subprocess."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from stppo_agent.algorithms import clip_bias as clip_bias_module
from stppo_agent.algorithms.clip_bias import ClipBiasCorrector
from stppo_agent.algorithms.segments import (
    broadcast_segments,
    check_turn_ids,
    discounted_reverse_cumsum,
    masked_mean,
    masked_sum,
    quantile,
    segment_counts,
    segment_sum,
    turn_segment_ids,
    whiten,
)

F64 = torch.float64


def t64(values):
    return torch.tensor(values, dtype=F64)


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


# --- segments -----------------------------------------------------------------------------------------------

def test_masked_sum_and_mean_ignore_masked_entries_even_nan():
    x = t64([[1.0, float("nan"), 3.0], [float("inf"), 5.0, 7.0]])
    mask = torch.tensor([[True, False, True], [False, True, False]])
    assert masked_sum(x, mask).item() == 9.0
    assert masked_sum(x, mask).dtype == F64
    assert masked_mean(x, mask).item() == 3.0
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0  # no entries: 0, not NaN
    counts = masked_sum(torch.tensor([[1, 2, 3]]), torch.tensor([[True, False, True]]))
    assert counts.dtype == torch.int64 and counts.item() == 4  # a sum of integers stays an integer
    one = torch.tensor([[False, False, False], [False, True, False]])
    assert masked_mean(x, one).item() == 5.0


def test_turn_segment_ids_flatten_row_and_turn_and_zero_off_the_mask():
    mask = torch.tensor([[True, True, False, True], [False, True, True, False]])
    turns = torch.tensor([[0, 0, -1, 2], [-1, 1, 3, -1]])
    ids, count = turn_segment_ids(turns, mask)
    assert count == 8
    assert ids.tolist() == [[0, 0, 0, 2], [0, 5, 7, 0]]
    # ids are clamped into the row's buckets, so a stray id cannot spill into the next row
    ids, _ = turn_segment_ids(torch.tensor([[9, -3]]), torch.tensor([[True, True]]))
    assert ids.tolist() == [[1, 0]]


def test_check_turn_ids_refuses_ids_outside_zero_to_t_on_policy_tokens_only():
    mask = torch.tensor([[True, True, False]])
    check_turn_ids(torch.tensor([[0, 2, -1]]), mask)  # T - 1 is fine; -1 off the mask is fine
    check_turn_ids(torch.tensor([[0, 1, 7]]), mask)
    with pytest.raises(ValueError, match=r"^turn_ids must be in \[0, T\) on every policy token \(loss_mask True\)$"):
        check_turn_ids(torch.tensor([[0, 3, 0]]), mask)
    with pytest.raises(ValueError, match="turn_ids"):
        check_turn_ids(torch.tensor([[-1, 0, 0]]), mask)


def test_segment_sum_counts_and_broadcast():
    x = t64([[1.0, 2.0, 0.0], [4.0, 0.0, 8.0]])
    ids = torch.tensor([[0, 0, 0], [3, 0, 5]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    torch.testing.assert_close(segment_sum(x, ids, 6), t64([3.0, 0.0, 0.0, 4.0, 0.0, 8.0]))
    counts = segment_counts(ids, 6, mask, F64)
    assert counts.dtype == F64 and counts.tolist() == [2.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    out = broadcast_segments(t64([10.0, 11.0, 12.0, 13.0, 14.0, 15.0]), ids)
    assert out.shape == (2, 3) and out.tolist() == [[10.0, 10.0, 10.0], [13.0, 10.0, 15.0]]
    x.requires_grad_(True)
    segment_sum(x, ids, 6)[3].backward()
    assert x.grad.tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_whiten_uses_the_unbiased_variance_and_eps():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    x = t64([[1.0, 2.0, 100.0], [6.0, -5.0, 7.0]])
    # mean 3, centered (-2, -1, 3), unbiased var 14 / 2 = 7
    torch.testing.assert_close(whiten(x, mask), t64([[-2.0, -1.0, 0.0], [3.0, 0.0, 0.0]]) / math.sqrt(7.0 + 1e-8))
    tiny = t64([[0.0, 2e-4]])
    both = torch.tensor([[True, True]])
    # var 2e-8: eps is not negligible
    torch.testing.assert_close(whiten(tiny, both), t64([[-1e-4, 1e-4]]) / math.sqrt(3e-8))
    torch.testing.assert_close(whiten(tiny, both, eps=0.0), t64([[-1e-4, 1e-4]]) / math.sqrt(2e-8))
    assert whiten(t64([[4.0, 9.0]]), torch.tensor([[True, False]])).tolist() == [[0.0, 0.0]]  # one entry: 0


@pytest.mark.parametrize("discount", [0.0, 0.5, 0.9, 1.0])
def test_discounted_reverse_cumsum_against_a_loop(discount):
    x = t64([[1.0, 2.0, -1.0, 4.0, 0.5, 3.0, 2.0]])
    expected = torch.zeros_like(x)
    running = 0.0
    for j in reversed(range(x.shape[1])):
        running = float(x[0, j]) + discount * running
        expected[0, j] = running
    torch.testing.assert_close(discounted_reverse_cumsum(x, discount), expected)
    assert discounted_reverse_cumsum(t64([[2.0]]), discount).tolist() == [[2.0]]
    # along the last dimension of any shape
    torch.testing.assert_close(discounted_reverse_cumsum(x[0], discount), expected[0])
    cube = torch.stack([x, 2 * x, -x])
    torch.testing.assert_close(discounted_reverse_cumsum(cube, discount), torch.stack([expected, 2 * expected,
                                                                                       -expected]))


def test_quantile_of_small_inputs():
    assert quantile(t64([1.0, 2.0, 3.0, 4.0, 5.0]), 0.5) == 3.0
    assert quantile(t64([0.0, 10.0]), 0.99) == pytest.approx(9.9)
    assert quantile(torch.tensor([3.0, 1.0, 2.0]), 0.0) == 1.0


# --- advantages ---------------------------------------------------------------------------------------------

from stppo_agent.algorithms import advantages as advantages_module  # noqa: E402
from stppo_agent.algorithms.advantages import (  # noqa: E402
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    compact_policy_positions,
    estimate_advantages,
    get_advantage_estimator,
    outcome_scores,
    register_advantage_estimator,
)
from stppo_agent.algorithms.config import AlgorithmConfig  # noqa: E402

from . import algorithm_reference as ref  # noqa: E402


def test_group_estimators_are_grpo_and_rloo_and_the_builtins_are_registered():
    assert GROUP_ESTIMATORS == {"grpo", "rloo"}
    assert {"gae", "grpo", "rloo", "turn_gae"} <= set(ADVANTAGE_ESTIMATORS)
    assert get_advantage_estimator("gae") is advantages_module.gae_advantages
    with pytest.raises(KeyError, match="unknown advantage estimator 'nope'; known: .*gae"):
        get_advantage_estimator("nope")


def test_estimate_advantages_hands_turn_ids_only_to_estimators_that_take_them():
    seen = {}

    def old_style(*, rewards, config):
        seen["old"] = True
        return rewards, rewards

    def with_turns(*, rewards, config, turn_ids=None):
        seen["with_turns"] = turn_ids
        return rewards, rewards

    def catch_all(*, rewards, **kwargs):
        seen["catch_all"] = kwargs.get("turn_ids")
        return rewards, rewards

    names = ["pin_old_style", "pin_with_turns", "pin_catch_all"]
    try:
        assert register_advantage_estimator(names[0], old_style) is old_style
        register_advantage_estimator(names[1])(with_turns)
        register_advantage_estimator(names[2], catch_all)
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator(names[0], with_turns)
        turns = torch.tensor([[0, 1]])
        rewards = t64([1.0])
        for name in names:
            assert estimate_advantages(name, turn_ids=turns, rewards=rewards, config=None)[0] is rewards
        assert seen["old"] is True and seen["with_turns"] is turns and seen["catch_all"] is turns
    finally:
        for name in names:
            ADVANTAGE_ESTIMATORS._items.pop(name, None)


def test_compact_policy_positions_puts_policy_tokens_first_in_order():
    mask = torch.tensor([[False, True, False, True, True], [True, False, False, False, True]])
    assert compact_policy_positions(mask).tolist() == [[1, 3, 4, 0, 2], [0, 4, 1, 2, 3]]


def test_gae_by_hand_skips_observations_and_uses_gamma_and_gamma_lambda():
    mask = torch.tensor([[True, False, True, True], [False, True, False, False], [False] * 4])
    values = t64([[1.0, 9.0, 2.0, 3.0], [7.0, 0.5, 7.0, 7.0], [1.0, 1.0, 1.0, 1.0]])
    kl = t64([[0.1, 99.0, 0.2, 0.3], [99.0, 0.25, 99.0, 99.0], [1.0] * 4])
    config = AlgorithmConfig(gamma=0.5, lam=0.8, whiten_advantages=False)
    advantages, returns = get_advantage_estimator("gae")(
        rewards=t64([5.0, 2.0, 1.0]), values=values, loss_mask=mask, group_ids=None, config=config, kl_penalty=kl)
    # row 0: r = (-0.1, -0.2, 5 - 0.3), V = (1, 2, 3), next V = (2, 3, 0)
    # deltas (-0.1, -0.7, 1.7); A = (-0.1 + 0.4 * -0.02, -0.7 + 0.4 * 1.7, 1.7)
    torch.testing.assert_close(advantages, t64([[-0.108, 0.0, -0.02, 1.7], [0.0, 2.0 - 0.25 - 0.5, 0.0, 0.0],
                                                [0.0] * 4]))
    torch.testing.assert_close(returns, t64([[0.892, 0.0, 1.98, 4.7], [0.0, 1.75, 0.0, 0.0], [0.0] * 4]))
    whitened, same_returns = get_advantage_estimator("gae")(
        rewards=t64([5.0, 2.0, 1.0]), values=values, loss_mask=mask, config=AlgorithmConfig(gamma=0.5, lam=0.8),
        kl_penalty=kl)
    torch.testing.assert_close(whitened, whiten(advantages, mask))
    torch.testing.assert_close(same_returns, returns)  # the critic's targets are never whitened
    no_kl, _ = get_advantage_estimator("gae")(rewards=t64([5.0, 2.0, 1.0]), values=values, loss_mask=mask,
                                              config=config)
    assert no_kl[0, 3].item() == pytest.approx(2.0)


def test_outcome_scores_subtract_the_masked_penalty_sum_in_float32_unless_float64():
    mask = torch.tensor([[True, False, True], [False, False, True]])
    kl = torch.tensor([[0.5, 100.0, 0.25], [100.0, 100.0, 1.0]])
    scores = outcome_scores(torch.tensor([1, 2]), mask, kl)
    assert scores.dtype == torch.float32 and scores.tolist() == [0.25, 1.0]
    assert outcome_scores(t64([1.0, 2.0]), mask, None).dtype == F64
    assert outcome_scores(torch.tensor([1.0, 2.0]), mask, kl.double()).dtype == torch.float32
    assert outcome_scores(torch.tensor([3, 4]), mask, None).tolist() == [3.0, 4.0]
    assert outcome_scores(torch.tensor([3.0, 4.0], dtype=torch.float16), mask, None).dtype == torch.float32


def _group_batch():
    rewards = t64([1.0, 0.0, 2.0, 3.0, 3.0, 5.0, 0.0, 2e-6])
    groups = torch.tensor([4, 4, 4, 1, 1, 9, 7, 7])
    mask = torch.ones(8, 2, dtype=torch.bool)
    mask[0, 1] = False
    return rewards, groups, mask


def test_grpo_by_hand_group_std_plus_1e6_and_a_lone_trajectory_gets_zero():
    rewards, groups, mask = _group_batch()
    config = AlgorithmConfig(advantage="grpo")
    advantages, returns = get_advantage_estimator("grpo")(rewards=rewards, loss_mask=mask, group_ids=groups,
                                                          config=config)
    assert returns is advantages and advantages.dtype == F64
    # group 4: mean 1, std 1 -> (0, -1, 1) / (1 + 1e-6); group 1: std 0 -> 0; group 9 alone -> 0
    # group 7: mean 1e-6, std sqrt(2) 1e-6 -> -+1e-6 / ((sqrt(2) + 1) 1e-6)
    edge = 1.0 / (math.sqrt(2.0) + 1.0)
    expected = t64([0.0, -1.0 / (1 + 1e-6), 1.0 / (1 + 1e-6), 0.0, 0.0, 0.0, -edge, edge])
    torch.testing.assert_close(advantages[:, 1], expected)
    assert advantages[0, 0].item() == 0.0 and advantages[2, 0].item() == pytest.approx(1.0 / (1 + 1e-6))
    dr, _ = get_advantage_estimator("grpo")(rewards=rewards, loss_mask=mask, group_ids=groups,
                                            config=AlgorithmConfig(grpo_std_normalize=False))
    torch.testing.assert_close(dr[:, 1], t64([0.0, -1.0, 1.0, 0.0, 0.0, 0.0, -1e-6, 1e-6]))
    as_values, _ = get_advantage_estimator("grpo")(rewards=rewards, values=torch.zeros(8, 2), loss_mask=mask,
                                                   group_ids=groups, config=config)
    assert as_values.dtype == torch.float32


def test_grpo_and_rloo_rank_by_reward_minus_the_trajectorys_own_kl_penalty():
    mask = torch.tensor([[True, True, False], [True, True, False]])
    kl = t64([[0.5, 0.5, 50.0], [0.0, 0.0, 0.0]])
    grpo, _ = get_advantage_estimator("grpo")(rewards=t64([1.0, 1.0]), loss_mask=mask, group_ids=torch.tensor([0, 0]),
                                              config=AlgorithmConfig(grpo_std_normalize=False), kl_penalty=kl)
    torch.testing.assert_close(grpo[:, 0], t64([-0.5, 0.5]))
    rloo, _ = get_advantage_estimator("rloo")(rewards=t64([1.0, 1.0]), loss_mask=mask, group_ids=torch.tensor([0, 0]),
                                              config=AlgorithmConfig(), kl_penalty=kl)
    torch.testing.assert_close(rloo, t64([[-1.0, -1.0, 0.0], [1.0, 1.0, 0.0]]))


def test_rloo_by_hand_leave_one_out_and_a_lone_trajectory_gets_zero():
    rewards, groups, mask = _group_batch()
    advantages, returns = get_advantage_estimator("rloo")(rewards=rewards, loss_mask=mask, group_ids=groups,
                                                          config=AlgorithmConfig())
    assert returns is advantages
    # group 4: 1 - 1, 0 - 1.5, 2 - 0.5; group 7: -2e-6, 2e-6
    torch.testing.assert_close(advantages[:, 1], t64([0.0, -1.5, 1.5, 0.0, 0.0, 0.0, -2e-6, 2e-6]))
    assert advantages[0, 0].item() == 0.0
    assert get_advantage_estimator("rloo")(rewards=rewards, values=torch.zeros(8, 2), loss_mask=mask,
                                           group_ids=groups, config=AlgorithmConfig())[0].dtype == torch.float32


def test_turn_gae_by_hand_values_at_each_turns_first_token_and_per_turn_penalties():
    mask = torch.tensor([[True, True, False, True, True, False, True], [False, True, True, False, False, False, False]])
    turns = torch.tensor([[0, 0, -1, 1, 1, -1, 3], [-1, 2, 2, -1, -1, -1, -1]])
    values = t64([[1.0, 50.0, 50.0, 2.0, 60.0, 50.0, 3.0], [9.0, 4.0, 70.0, 9.0, 9.0, 9.0, 9.0]])
    kl = t64([[0.1, 0.2, 80.0, 0.3, 0.4, 80.0, 0.5], [80.0, 0.5, 0.25, 80.0, 80.0, 80.0, 80.0]])
    config = AlgorithmConfig(gamma=0.5, lam=0.8, whiten_advantages=False)
    advantages, returns = estimate_advantages("turn_gae", rewards=t64([4.0, 1.0]), values=values, loss_mask=mask,
                                              group_ids=None, config=config, kl_penalty=kl, turn_ids=turns)
    # row 0: turns 0, 1, 3 with V (1, 2, 3), r (-0.3, -0.7, 4 - 0.5): deltas (-0.3, -1.2, 0.5)
    # A = (-0.3 + 0.4 * -1.0, -1.2 + 0.4 * 0.5, 0.5); row 1: one turn, V 4, r 1 - 0.75 -> A -3.75
    a_row0 = [-0.7, -0.7, 0.0, -1.0, -1.0, 0.0, 0.5]
    torch.testing.assert_close(advantages, t64([a_row0, [0.0, -3.75, -3.75, 0.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(returns, t64([[0.3, 0.3, 0.0, 1.0, 1.0, 0.0, 3.5],
                                             [0.0, 0.25, 0.25, 0.0, 0.0, 0.0, 0.0]]))
    whitened, _ = estimate_advantages("turn_gae", rewards=t64([4.0, 1.0]), values=values, loss_mask=mask,
                                      config=AlgorithmConfig(gamma=0.5, lam=0.8), kl_penalty=kl, turn_ids=turns)
    torch.testing.assert_close(whitened, whiten(advantages, mask))
    plain, _ = estimate_advantages("turn_gae", rewards=t64([4.0, 1.0]), values=values, loss_mask=mask,
                                   config=config, turn_ids=turns)
    assert plain[1, 1].item() == pytest.approx(-3.0)
    with pytest.raises(ValueError, match="turn_gae needs turn_ids"):
        get_advantage_estimator("turn_gae")(rewards=t64([4.0, 1.0]), values=values, loss_mask=mask, config=config)
    with pytest.raises(ValueError, match="turn_ids must be in"):
        estimate_advantages("turn_gae", rewards=t64([4.0, 1.0]), values=values, loss_mask=mask, config=config,
                            turn_ids=torch.where(mask, 7, -1))


def test_turn_gae_float32_matches_the_reference_loop():
    mask = torch.tensor([[True, True, False, True], [True, False, True, True]])
    turns = torch.tensor([[0, 0, -1, 2], [1, -1, 1, 3]])
    values = torch.tensor([[0.5, 1.0, 2.0, -1.0], [0.25, 3.0, 1.5, 2.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]])
    config = AlgorithmConfig(gamma=0.9, lam=0.7, whiten_advantages=False)
    got, got_returns = estimate_advantages("turn_gae", rewards=torch.tensor([1.0, 0.0]), values=values,
                                           loss_mask=mask, config=config, kl_penalty=kl, turn_ids=turns)
    want, want_returns = ref.ref_turn_gae(torch.tensor([1.0, 0.0]), values, mask, turns, 0.9, 0.7, kl)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_returns, want_returns)


# --- losses -------------------------------------------------------------------------------------------------

from stppo_agent.algorithms import losses as losses_module  # noqa: E402
from stppo_agent.algorithms.losses import (  # noqa: E402
    POLICY_LOSSES,
    WHOLE_BATCH_STATISTICS,
    aggregate,
    aggregate_parts,
    aggregation_kwargs,
    explained_variance,
    get_policy_loss,
    kl_estimate,
    kl_reward_penalty,
    log_ratio_at_level,
    register_policy_loss,
    register_whole_batch_statistic,
    value_loss,
)


def test_policy_loss_and_whole_batch_statistic_registries():
    assert get_policy_loss("ppo_clip") is losses_module.ppo_clip_loss
    assert {"ppo_clip", "cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "m2po"} <= set(POLICY_LOSSES)
    assert set(WHOLE_BATCH_STATISTICS) == {"m2po"}
    with pytest.raises(KeyError, match="unknown policy loss 'nope'; known: cispo, "):
        get_policy_loss("nope")

    def loss(**kwargs):
        return None

    try:
        assert register_policy_loss("pin_loss", loss) is loss
        assert register_policy_loss("pin_loss_2")(loss) is loss
        assert register_whole_batch_statistic("pin_loss", loss) is loss
        assert register_whole_batch_statistic("pin_loss_2")(loss) is loss
        assert POLICY_LOSSES["pin_loss_2"] is loss and WHOLE_BATCH_STATISTICS["pin_loss_2"] is loss
        with pytest.raises(ValueError, match="^policy loss 'pin_loss' is already registered; choose another name$"):
            register_policy_loss("pin_loss", loss)
    finally:
        for name in ("pin_loss", "pin_loss_2"):
            POLICY_LOSSES._items.pop(name, None)
            WHOLE_BATCH_STATISTICS._items.pop(name, None)


def _ratio_batch():
    """Two rows: (1.5, 0.8, 1.2) and (0.5, masked, 1.0) as ratios, turns (0, 0, 1) and (0, -, 1)."""
    mask = torch.tensor([[True, True, True], [True, False, True]])
    turns = torch.tensor([[0, 0, 1], [0, -1, 1]])
    old = t64([[-1.0, -2.0, -0.5], [-1.5, -3.0, -0.7]])
    log_ratio = t64([[math.log(1.5), math.log(0.8), math.log(1.2)], [math.log(0.5), 5.0, 0.0]])
    logprobs = (old + log_ratio).requires_grad_(True)
    advantages = t64([[1.0, -1.0, 2.0], [-2.0, 9.0, 0.0]])
    return logprobs, old, advantages, mask, turns


def test_log_ratio_at_each_level_by_hand():
    logprobs, old, _, mask, turns = _ratio_batch()
    l00, l01, l02, l10 = math.log(1.5), math.log(0.8), math.log(1.2), math.log(0.5)
    token = log_ratio_at_level(logprobs, old, mask, turns, "token")
    torch.testing.assert_close(token, t64([[l00, l01, l02], [l10, 0.0, 0.0]]))
    turn = log_ratio_at_level(logprobs, old, mask, turns, "turn")
    torch.testing.assert_close(turn, t64([[(l00 + l01) / 2, (l00 + l01) / 2, l02], [l10, 0.0, 0.0]]))
    sequence = log_ratio_at_level(logprobs, old, mask, turns, "sequence")
    row0 = (l00 + l01 + l02) / 3
    torch.testing.assert_close(sequence, t64([[row0, row0, row0], [l10 / 2, 0.0, l10 / 2]]))
    sequence.sum().backward()  # the gradient flows to every token of the segment, none to a masked one
    torch.testing.assert_close(logprobs.grad, t64([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]]))
    with pytest.raises(ValueError, match="^unknown ratio level 'word'; known: token, turn, sequence$"):
        log_ratio_at_level(logprobs, old, mask, turns, "word")
    one = log_ratio_at_level(t64([[0.5, 9.0]]), torch.zeros(1, 2, dtype=F64), torch.tensor([[True, False]]),
                             torch.tensor([[0, -1]]), "sequence")
    assert one.tolist() == [[0.5, 0.0]]  # a one-token trajectory's mean is its token's


def test_aggregate_modes_counts_and_global_normalisers():
    per_token = t64([[1.0, 2.0, 3.0], [4.0, 100.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, True], [False, False, False]])
    total, count = aggregate_parts(per_token, mask, "token-mean")
    assert (total.item(), count.item()) == (16.0, 5)
    assert aggregate(per_token, mask, "token-mean").item() == pytest.approx(3.2)
    assert aggregate(per_token, mask, "token-mean", global_num_tokens=8, global_num_seqs=1).item() == 2.0
    total, count = aggregate_parts(per_token, mask, "seq-mean-token-mean")
    assert (total.item(), count.item()) == (7.0, 2)  # the empty row is not a trajectory of the mean
    assert aggregate(per_token, mask, "seq-mean-token-mean").item() == 3.5
    assert aggregate(per_token, mask, "seq-mean-token-mean", global_num_tokens=1, global_num_seqs=7).item() == 1.0
    total, count = aggregate_parts(per_token, mask, "seq-mean-token-sum-norm", scale=4.0)
    assert (total.item(), count.item()) == (4.0, 2)  # (6 + 10) / 4
    assert aggregate(per_token, mask, "seq-mean-token-sum-norm", scale=4.0).item() == 2.0
    assert aggregate(per_token, mask, "seq-mean-token-sum-norm", global_num_seqs=8).item() == 2.0  # scale 1
    total, _ = aggregate_parts(per_token, mask, "seq-mean-token-sum-norm")
    assert total.item() == 16.0  # the constant defaults to 1
    single = torch.tensor([[True, False, False], [False, False, False], [False, False, False]])
    assert aggregate(per_token, single, "token-mean").item() == 1.0
    assert aggregate(per_token, single, "seq-mean-token-mean").item() == 1.0
    empty = torch.zeros_like(mask)
    assert aggregate(per_token, empty, "token-mean").item() == 0.0
    assert aggregate(per_token, empty, "seq-mean-token-mean").item() == 0.0
    with pytest.raises(ValueError, match="^unknown loss_agg 'sum'; known: token-mean, seq-mean-token-mean, "
                                         "seq-mean-token-sum-norm$"):
        aggregate(per_token, mask, "sum")


def test_aggregation_kwargs_read_the_config_and_default_the_scale_to_one():
    config = AlgorithmConfig(loss_agg="seq-mean-token-sum-norm", loss_scale_factor=64.0)
    assert aggregation_kwargs(config, 5, 2) == dict(mode="seq-mean-token-sum-norm", global_num_tokens=5,
                                                    global_num_seqs=2, scale=64.0)

    class Own:
        loss_agg = "token-mean"

    assert aggregation_kwargs(Own()) == dict(mode="token-mean", global_num_tokens=None, global_num_seqs=None,
                                             scale=1.0)


def test_kl_estimators_by_hand_with_verls_clamps():
    logprobs = t64([0.5, 30.0, -30.0, -12.0])
    ref_logprobs = torch.zeros(4, dtype=F64)
    assert kl_estimate(logprobs, ref_logprobs, "k1").tolist() == logprobs.tolist()
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, "k2"), 0.5 * logprobs**2)  # k2 is not clamped
    k3 = t64([math.exp(-0.5) - 1 + 0.5, math.exp(-20.0) - 1 + 20.0, math.exp(20.0) - 1 - 20.0,
              math.exp(12.0) - 1 - 12.0])
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, "k3"), k3)
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, "low_var_kl"),
                               t64([math.exp(-0.5) - 0.5, 10.0, 10.0, 10.0]))
    assert kl_estimate(t64([-1.0]), t64([1.0]), "low_var_kl").item() == pytest.approx(math.exp(2.0) - 3.0)
    assert kl_estimate(t64([1.0]), t64([0.0]), "k3").item() == pytest.approx(math.exp(-1.0))
    with pytest.raises(ValueError, match="^unknown KL estimator 'k4'; known: k1, k2, k3, low_var_kl$"):
        kl_estimate(logprobs, ref_logprobs, "k4")


def test_kl_reward_penalty_is_the_coefficient_times_k1_on_policy_tokens():
    old = t64([[-1.0, -2.0, -3.0]])
    ref_logprobs = t64([[-1.5, -1.0, -30.0]])
    mask = torch.tensor([[True, True, False]])
    penalty = kl_reward_penalty(old, ref_logprobs, mask, AlgorithmConfig(kl_in_reward=0.1))
    torch.testing.assert_close(penalty, t64([[0.05, -0.1, 0.0]]))


def _ppo(config, **kwargs):
    logprobs, old, advantages, mask, turns = _ratio_batch()
    loss, bias, metrics = get_policy_loss("ppo_clip")(logprobs=logprobs, old_logprobs=old, advantages=advantages,
                                                      loss_mask=mask, turn_ids=turns, config=config, **kwargs)
    return logprobs, loss, bias, metrics


def test_ppo_clip_by_hand_loss_clipped_set_bias_and_metrics():
    """Ratios 1.5 (A 1), 0.8 (A -1), 1.2 (A 2), 0.5 (A -2), 1.0 (A 0); eps_low 0.1, eps_high 0.3."""
    config = AlgorithmConfig(clip_low=0.1, clip_high=0.3)
    logprobs, loss, bias, metrics = _ppo(config)
    # L = (-1.3, 0.9, -2.4, 1.8, 0) / 5; clipped: the 1.5, 0.8 and 0.5 tokens
    assert loss.item() == pytest.approx(-0.2)
    assert metrics["pg_loss"].item() == pytest.approx(-0.2)
    torch.testing.assert_close(metrics.parts["pg_loss"].sums, t64([-1.0, 5.0]))
    assert bias.item() == pytest.approx((1.5 - 0.8 - 1.0) / 5)
    assert metrics["clip_frac"].item() == pytest.approx(0.6)
    torch.testing.assert_close(metrics.parts["clip_frac"].sums, t64([3.0, 5.0]))
    # turns: sqrt(1.2) and 1.2 inside [0.9, 1.3], 0.5 outside, 1.0 inside
    assert metrics["turn_clip_frac"].item() == pytest.approx(0.25)
    torch.testing.assert_close(metrics.parts["turn_clip_frac"].sums, t64([1.0, 4.0]))
    assert metrics["ratio/mean"].item() == pytest.approx(1.0)
    assert metrics["ratio/max"].item() == pytest.approx(1.5) and metrics.parts["ratio/max"].op == "max"
    assert metrics["ratio/min"].item() == pytest.approx(0.5) and metrics.parts["ratio/min"].op == "min"
    kl = sum(r - 1 - math.log(r) for r in (1.5, 0.8, 1.2, 0.5, 1.0)) / 5
    assert metrics["approx_kl"].item() == pytest.approx(kl)
    # effective sample size of the token ratios: (sum w)^2 / (n sum w^2)
    assert metrics["ratio/ess"].item() == pytest.approx(5.0**2 / (5 * (2.25 + 0.64 + 1.44 + 0.25 + 1.0)))
    torch.testing.assert_close(metrics.parts["ratio/ess"].sums, t64([5.0, 5.58, 5.0]))
    assert set(metrics) == {"pg_loss", "clip_frac", "turn_clip_frac", "ratio/mean", "ratio/max", "ratio/min",
                            "ratio/ess", "approx_kl"}
    (grad,) = torch.autograd.grad(loss, logprobs, retain_graph=True)
    torch.testing.assert_close(grad, t64([[0.0, 0.0, -2.4 / 5], [0.0, 0.0, 0.0]]))  # clipped tokens: none
    (bias_grad,) = torch.autograd.grad(bias, logprobs)
    torch.testing.assert_close(bias_grad, t64([[1.5 / 5, -0.8 / 5, 0.0], [-1.0 / 5, 0.0, 0.0]]))


def test_ppo_clip_global_normalisers_and_the_regularisers():
    config = AlgorithmConfig(clip_low=0.1, clip_high=0.3, kl_loss_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    logprobs, old, advantages, mask, turns = _ratio_batch()
    ref_logprobs = logprobs.detach() - t64([[1.0, 2.0, 3.0], [4.0, 50.0, 5.0]])
    entropy = t64([[1.0, 1.0, 1.0], [2.0, 90.0, 5.0]])
    loss, bias, metrics = get_policy_loss("ppo_clip")(logprobs=logprobs, old_logprobs=old, advantages=advantages,
                                                      loss_mask=mask, turn_ids=turns, config=config,
                                                      ref_logprobs=ref_logprobs, entropy=entropy,
                                                      global_num_tokens=10, global_num_seqs=3)
    assert metrics["pg_loss"].item() == pytest.approx(-0.1)
    assert metrics["kl_loss"].item() == pytest.approx(1.5)
    assert metrics["entropy"].item() == pytest.approx(1.0)
    torch.testing.assert_close(metrics.parts["entropy"].sums, t64([10.0, 5.0]))
    assert loss.item() == pytest.approx(-0.1 + 0.5 * 1.5 - 0.1 * 1.0)
    assert bias.item() == pytest.approx((1.5 - 0.8 - 1.0) / 10)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # KL k1 gradient 0.5 / 10 on every policy token, on top of the surrogate's
    torch.testing.assert_close(grad, t64([[0.05, 0.05, 0.05 - 2.4 / 10], [0.05, 0.0, 0.05]]))
    no_kl = AlgorithmConfig(clip_low=0.1, clip_high=0.3, kl_loss_coef=0.0)
    _, loss, _, metrics = _ppo(no_kl, ref_logprobs=ref_logprobs)
    assert "kl_loss" not in metrics and loss.item() == pytest.approx(-0.2)


def test_ppo_clip_boundary_ratio_at_the_bound_is_not_clipped_and_nothing_clipped_detaches_the_bias():
    mask = torch.tensor([[True, True, True]])
    logprobs = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    config = AlgorithmConfig(clip_low=0.0, clip_high=0.0)  # the ratio 1 sits on both bounds
    loss, bias, metrics = get_policy_loss("ppo_clip")(
        logprobs=logprobs, old_logprobs=torch.zeros(1, 3, dtype=F64), advantages=t64([[1.0, -1.0, 0.0]]),
        loss_mask=mask, turn_ids=torch.zeros(1, 3, dtype=torch.long), config=config)
    assert metrics["clip_frac"].item() == 0.0 and metrics["turn_clip_frac"].item() == 0.0
    assert not bias.requires_grad and bias.item() == 0.0
    assert loss.requires_grad


def test_ppo_clip_at_sequence_level_by_hand_with_turn_metrics_from_the_turn_ratios():
    config = AlgorithmConfig(clip_low=0.1, clip_high=0.3, ratio_level="sequence")
    logprobs, loss, bias, metrics = _ppo(config)
    row0 = (1.5 * 0.8 * 1.2) ** (1 / 3)  # inside [0.9, 1.3]
    row1 = math.sqrt(0.5)  # below 0.9: clipped for its A = -2 token
    assert loss.item() == pytest.approx((-row0 * (1.0 - 1.0 + 2.0) + 0.9 * 2.0) / 5)
    assert metrics["clip_frac"].item() == pytest.approx(0.2)
    assert metrics["turn_clip_frac"].item() == pytest.approx(0.25)  # the turns' own ratios, as at token level
    assert bias.item() == pytest.approx(row1 * -2.0 / 5)


def test_ppo_clip_on_one_token_turns_and_with_dr_grpos_constant_normaliser():
    logprobs = t64([[math.log(1.5), 0.0, math.log(1.5)]]).requires_grad_(True)
    mask = torch.tensor([[True, False, False]])
    kwargs = dict(logprobs=logprobs, old_logprobs=torch.zeros(1, 3, dtype=F64), advantages=t64([[-2.0, 0.0, 0.0]]),
                  turn_ids=torch.tensor([[0, -1, -1]]))
    loss, _, metrics = get_policy_loss("ppo_clip")(loss_mask=mask, config=AlgorithmConfig(clip_high=0.3), **kwargs)
    assert loss.item() == pytest.approx(3.0)  # one token: -(1.5 * -2), its own mean
    assert metrics["turn_clip_frac"].item() == 1.0  # a one-token turn at 1.5 is outside [0.8, 1.3]
    both = torch.tensor([[True, False, True]])
    config = AlgorithmConfig(loss_agg="seq-mean-token-sum-norm", loss_scale_factor=4.0, clip_high=0.6)
    loss, _, metrics = get_policy_loss("ppo_clip")(loss_mask=both, config=config, **kwargs)
    assert loss.item() == pytest.approx(3.0 / 4) and metrics["pg_loss"].item() == pytest.approx(3.0 / 4)
    assert metrics["turn_clip_frac"].item() == 0.0


def test_ppo_clip_clamps_the_log_ratio_at_20_before_exp():
    mask = torch.tensor([[True, True]])
    logprobs = torch.tensor([[30.0, -30.0]], requires_grad=True)
    loss, _, metrics = get_policy_loss("ppo_clip")(
        logprobs=logprobs, old_logprobs=torch.zeros(1, 2), advantages=t64([[-1.0, 1.0]]),
        loss_mask=mask, turn_ids=torch.zeros(1, 2, dtype=torch.long), config=AlgorithmConfig())
    assert loss.dtype == torch.float32  # the model's dtype, whatever the advantages'
    # A < 0 with a huge ratio: the unclipped branch -(-e^20); A > 0 with a tiny one: -e^-20
    assert loss.item() == pytest.approx((math.exp(20.0) - math.exp(-20.0)) / 2, rel=1e-5)
    assert metrics["ratio/max"].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert metrics["ratio/min"].item() == pytest.approx(math.exp(-20.0), rel=1e-5)


def test_values_inside_the_clip_range_are_never_counted_clipped():
    """Inside the range the clipped value must be V itself: old + (V - old) rounds differently from V when V and
    V_old differ in magnitude, and the strict comparison then counted a rounding difference as a clip (7.7% of these
    tokens; a one- and a two-process run of one batch disagreed on the metric)."""
    torch.manual_seed(0)
    values = (torch.randn(1, 4000) * 0.01).requires_grad_(True)
    old_values = torch.rand(1, 4000) * 0.8 - 0.4  # every |V - V_old| < 0.5
    returns = torch.randn(1, 4000)
    mask = torch.ones(1, 4000, dtype=torch.bool)
    loss, metrics = value_loss(values=values, old_values=old_values, returns=returns, loss_mask=mask,
                               config=AlgorithmConfig(value_clip=0.5))
    assert metrics["value_clip_frac"].item() == 0.0
    assert loss.item() == pytest.approx(0.5 * float(((values.detach() - returns) ** 2).mean()), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, values)
    torch.testing.assert_close(grad, (values - returns).detach() / 4000)  # every token on the unclipped branch


def test_value_loss_by_hand_clip_fraction_and_explained_variance():
    values = t64([[1.0, 2.0, 3.0, 7.0]]).requires_grad_(True)
    old_values = t64([[0.0, 2.0, 4.0, 0.0]])
    returns = t64([[2.0, 1.0, 3.0, 9.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, metrics = value_loss(values=values, old_values=old_values, returns=returns, loss_mask=mask,
                               config=AlgorithmConfig(value_clip=0.5))
    # clipped V: (0.5, 2, 3.5); errors (1, 1, 0) vs (2.25, 1, 0.25): max (2.25, 1, 0.25)
    assert loss.item() == pytest.approx(0.5 * 3.5 / 3)
    torch.testing.assert_close(metrics.parts["value_loss"].sums, t64([0.5 * 3.5, 3.0]))
    assert metrics["value_clip_frac"].item() == pytest.approx(2 / 3)  # strictly larger clipped error only
    torch.testing.assert_close(metrics.parts["value_clip_frac"].sums, t64([2.0, 3.0]))
    # residuals (1, -1, 0): var 2/3; targets (2, 1, 3): var 2/3 -> 0
    assert metrics["explained_variance"].item() == pytest.approx(0.0, abs=1e-12)
    assert metrics.parts["explained_variance"].finish(metrics.parts["explained_variance"].sums).item() == \
        pytest.approx(0.0, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, values)
    # tokens 0 and 2 take the clipped branch, which V past the bound does not move
    torch.testing.assert_close(grad, t64([[0.0, 1.0 / 3, 0.0, 0.0]]))
    loss, _ = value_loss(values=values, old_values=old_values, returns=returns, loss_mask=mask,
                         config=AlgorithmConfig(value_clip=10.0), global_num_tokens=6)
    assert loss.item() == pytest.approx(0.5 * 2.0 / 6)


def test_explained_variance_by_hand_and_from_summed_parts():
    mask = torch.tensor([[True, True, True, True, False]])
    targets = t64([[1.0, 2.0, 3.0, 6.0, 100.0]])
    predictions = t64([[1.0, 3.0, 3.0, 5.0, -100.0]])
    # residuals (0, -1, 0, 1): var 0.5; targets: mean 3, var 3.5
    assert explained_variance(predictions, targets, mask).item() == pytest.approx(1 - 0.5 / 3.5)
    sums = losses_module._variance_sums(predictions, targets, mask)
    torch.testing.assert_close(sums, t64([0.0, 2.0, 12.0, 50.0, 4.0]))
    assert losses_module._explained_variance_from_sums(sums).item() == pytest.approx(1 - 0.5 / 3.5)
    # targets whose spread is rounding (below 1e-10 of their mean square) count as constant
    flat = t64([1e6, 1e6, 1e6, 1e6]).unsqueeze(0) + t64([[0.0, 1e-3, 0.0, 1e-3]])
    all4 = torch.ones(1, 4, dtype=torch.bool)
    tiny = losses_module._variance_sums(torch.zeros_like(flat), flat, all4)
    assert losses_module._explained_variance_from_sums(tiny).item() == 0.0
    spread = t64([[0.0, 2e-5, 0.0, 2e-5]])  # variance 1e-10, mean square 2e-10: above the cut
    sums = losses_module._variance_sums(spread * 0.5, spread, all4)
    assert losses_module._explained_variance_from_sums(sums).item() == pytest.approx(0.75)
    assert losses_module._explained_variance_from_sums(torch.zeros(5, dtype=F64)).item() == 0.0
    # a spread of 1e-9 around 1 (mean square 1, 4 tokens) is real
    d = math.sqrt(1e-9)
    near_one = t64([[1 + d, 1 - d, 1 + d, 1 - d]])
    sums = losses_module._variance_sums(1 + 0.5 * (near_one - 1), near_one, all4)
    assert losses_module._explained_variance_from_sums(sums).item() == pytest.approx(0.75, rel=1e-4)
    # one token has no variance: 0
    one = torch.tensor([[True]])
    assert losses_module._explained_variance_from_sums(losses_module._variance_sums(t64([[1.0]]), t64([[2.0]]),
                                                                                   one)).item() == 0.0


def test_explained_variance_centres_the_residuals_and_reads_small_and_zero_target_variances():
    mask = torch.tensor([[True, True, True, True]])
    targets = t64([[1.0, 2.0, 3.0, 6.0]])
    # residuals (1, 0, 0, 2): mean 0.75, variance 0.6875; targets' variance 3.5
    assert explained_variance(t64([[0.0, 2.0, 3.0, 4.0]]), targets, mask).item() == pytest.approx(1 - 0.6875 / 3.5)
    small = t64([[0.0, 0.5, 0.0, 0.5]])  # variance 0.0625, below 1
    assert explained_variance(small * 0.5, small, mask).item() == pytest.approx(0.75)
    constant = t64([[2.0, 2.0, 2.0, 2.0]])
    assert explained_variance(t64([[1.0, 3.0, 2.0, 2.0]]), constant, mask).item() == 0.0


# --- stabilizers --------------------------------------------------------------------------------------------

RATIOS = [(0, 0, 1.5, 1.0), (0, 1, 0.8, -1.0), (0, 2, 1.2, 2.0), (1, 0, 0.5, -2.0), (1, 2, 1.0, 0.0)]
"""(row, column, ratio, advantage) of the policy tokens of :func:`_ratio_batch` (5 tokens, 4 turns)."""


def _rule(name, config, advantages=None, **kwargs):
    logprobs, old, batch_advantages, mask, turns = _ratio_batch()
    loss, bias, metrics = get_policy_loss(name)(
        logprobs=logprobs, old_logprobs=old, advantages=batch_advantages if advantages is None else advantages,
        loss_mask=mask, turn_ids=turns, config=config, **kwargs)
    grad, bias_grad = torch.autograd.grad(loss, logprobs, retain_graph=True)[0], None
    if bias.requires_grad:
        bias_grad = torch.autograd.grad(bias, logprobs)[0]
    return logprobs.detach(), loss, bias, metrics, grad, bias_grad


def _grid(values):
    """Per-token values of RATIOS' order on the (2, 3) batch grid (0 at the masked position)."""
    out = torch.zeros(2, 3, dtype=F64)
    for (row, column, _, _), value in zip(RATIOS, values):
        out[row, column] = value
    return out


def test_cispo_by_hand_weights_capped_changed_tokens_and_the_removed_share():
    config = AlgorithmConfig(clip_low=0.1, clip_high=0.3)
    logprobs, loss, bias, metrics, grad, bias_grad = _rule("cispo", config)
    weights = [1.3, 0.9, 1.2, 0.9, 1.0]
    expected = -sum(w * a * float(logprobs[r, c]) for w, (r, c, _, a) in zip(weights, RATIOS)) / 5
    assert loss.item() == pytest.approx(expected)
    torch.testing.assert_close(grad, _grid([-w * a / 5 for w, (_, _, _, a) in zip(weights, RATIOS)]))
    assert metrics["clip_frac"].item() == pytest.approx(0.6)  # 1.5, 0.8, 0.5: outside [0.9, 1.3]
    assert metrics["turn_clip_frac"].item() == pytest.approx(0.5)  # turns (0, 0) and (1, 0)
    torch.testing.assert_close(metrics.parts["turn_clip_frac"].sums, t64([2.0, 4.0]))
    assert bias.item() == pytest.approx((0.2 + 0.1 + 0.8) / 5)  # agg((rho - w) A)
    torch.testing.assert_close(bias_grad, _grid([0.2 / 5, 0.1 / 5, 0.0, 0.8 / 5, 0.0]))


def test_sapo_by_hand_gate_temperatures_by_advantage_sign_and_removed_share():
    config = AlgorithmConfig(tau_pos=2.0, tau_neg=0.5, loss_agg="token-mean")
    _, loss, bias, metrics, grad, bias_grad = _rule("sapo", config)
    gates, per_token, grads, removed = [], [], [], []
    for _, _, ratio, advantage in RATIOS:
        tau = 2.0 if advantage > 0 else 0.5
        gate = 1 / (1 + math.exp(-tau * (ratio - 1)))
        gates.append(gate)
        per_token.append(-gate * 4 / tau * advantage)
        grads.append(-4 * gate * (1 - gate) * ratio * advantage / 5)
        removed.append(1 - 4 * gate * (1 - gate))
    assert loss.item() == pytest.approx(sum(per_token) / 5)
    torch.testing.assert_close(grad, _grid(grads))
    assert metrics["clip_frac"].item() == pytest.approx(sum(removed) / 5)
    expected_bias = sum(s * r * a for s, (_, _, r, a) in zip(removed, RATIOS)) / 5
    assert bias.item() == pytest.approx(expected_bias)
    assert metrics["turn_clip_frac"].item() == pytest.approx(0.75)  # every turn but (1, 1), ratio 1
    assert bias_grad is not None


def test_gmpo_by_hand_sign_aware_log_clipping():
    config = AlgorithmConfig(clip_low=0.1, clip_high=0.3)
    _, loss, bias, metrics, grad, _ = _rule("gmpo", config)
    clipped = [0.3, -0.1, math.log(1.2), -0.1, 0.0]
    per_token = [-a * math.exp(c) for c, (_, _, _, a) in zip(clipped, RATIOS)]
    assert loss.item() == pytest.approx(sum(per_token) / 5)
    torch.testing.assert_close(grad, _grid([0.0, 0.0, -2.4 / 5, 0.0, 0.0]))
    assert metrics["clip_frac"].item() == pytest.approx(0.6)
    assert metrics["turn_clip_frac"].item() == pytest.approx(0.5)
    assert bias.item() == pytest.approx((1.5 - 0.8 + 2.4 - 1.0) / 5 + sum(per_token) / 5)
    flipped = -_ratio_batch()[2]  # every log-ratio now moves against its advantage: none is bounded
    _, loss, bias, metrics, _, _ = _rule("gmpo", config, advantages=flipped)
    assert loss.item() == pytest.approx((1.5 - 0.8 + 2.4 - 1.0) / 5)
    assert metrics["clip_frac"].item() == 0.0 and metrics["turn_clip_frac"].item() == 0.0
    assert not bias.requires_grad and bias.item() == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("rule, low, high", [("dppo_tv", 0.1, 0.15), ("dppo_kl", 0.04, 0.05)])
def test_dppo_by_hand_drops_tokens_moved_past_the_threshold_in_their_advantages_direction(rule, low, high):
    """p - p_old: 0.184, -0.027, 0.121, -0.112, 0; binary KL: 0.068, 0.004, 0.034, 0.050, 0."""
    config = AlgorithmConfig(clip_low=low, clip_high=high, is_cap=1.1)
    _, loss, bias, metrics, grad, _ = _rule(rule, config)
    # dropped: 1.5 (A > 0, moved up) and 0.5 (A < 0, moved down); 1.2 capped at 1.1
    torch.testing.assert_close(grad, _grid([0.0, 0.8 / 5, -1.1 * 2 / 5, 0.0, 0.0]))
    assert metrics["clip_frac"].item() == pytest.approx(0.6)
    assert metrics["turn_clip_frac"].item() == pytest.approx(0.75)
    assert bias.item() == pytest.approx((1.5 + 0.2 - 1.0) / 5)
    # the same moves against the advantage's direction are kept: only the cap changes 1.5 and 1.2
    _, _, bias, metrics, grad, _ = _rule(rule, config, advantages=-_ratio_batch()[2])
    torch.testing.assert_close(grad, _grid([1.1 / 5, -0.8 / 5, 1.1 * 2 / 5, -0.5 * 2 / 5, 0.0]))
    assert metrics["clip_frac"].item() == pytest.approx(0.4)
    assert bias.item() == pytest.approx((-0.4 - 0.2) / 5)


def test_m2po_by_hand_drops_the_largest_squared_log_ratios_until_the_mean_is_below_the_threshold():
    config = AlgorithmConfig(m2_threshold=0.04)
    squares = [math.log(r) ** 2 for _, _, r, _ in RATIOS]
    _, loss, bias, metrics, grad, _ = _rule("m2po", config)
    # sorted: 0.48 (0.5), 0.16 (1.5), 0.05, 0.03, 0: the tail means fall below 0.04 after the two largest
    assert loss.item() == pytest.approx((0.8 - 2.4) / 5)
    torch.testing.assert_close(grad, _grid([0.0, 0.8 / 5, -2.4 / 5, 0.0, 0.0]))
    assert metrics["clip_frac"].item() == pytest.approx(0.4)
    assert metrics["turn_clip_frac"].item() == pytest.approx(0.5)
    assert bias.item() == pytest.approx((1.5 - 1.0) / 5)
    assert metrics["m2po/second_moment"].item() == pytest.approx(sum(squares) / 5)
    assert metrics.parts["m2po/second_moment"].op == "max"
    keep = torch.tensor([[True, True, True], [False, True, True]])  # a mask taken over a larger batch
    _, loss, bias, metrics, _, _ = _rule("m2po", config, keep=keep, second_moment=torch.tensor(0.5, dtype=F64))
    assert loss.item() == pytest.approx(-(1.5 - 0.8 + 2.4) / 5)  # the masked position stays out
    assert metrics["clip_frac"].item() == pytest.approx(0.2)
    assert metrics["m2po/second_moment"].item() == 0.5
    assert bias.item() == pytest.approx(-1.0 / 5)


# --- second_moment ------------------------------------------------------------------------------------------

from stppo_agent.algorithms import second_moment as second_moment_module  # noqa: E402
from stppo_agent.algorithms.second_moment import (  # noqa: E402
    keep_items,
    m2po_keep_mask,
    m2po_keep_masks,
    segment_ids,
)
from stppo_agent.algorithms.stabilizers import m2po_whole_batch  # noqa: E402


def test_m2po_segment_ids_per_level():
    mask = torch.tensor([[True, False, True], [False, True, True]])
    turns = torch.tensor([[0, -1, 2], [-1, 1, 1]])
    ids, count = segment_ids(mask, turns, "token")
    assert (ids.tolist(), count) == ([[0, 0, 2], [0, 4, 5]], 6)
    ids, count = segment_ids(mask, turns, "turn")
    assert (ids.tolist(), count) == ([[0, 0, 2], [0, 4, 4]], 6)
    ids, count = segment_ids(mask, turns, "sequence")
    assert (ids.tolist(), count) == ([[0, 0, 0], [0, 1, 1]], 2)
    with pytest.raises(ValueError, match="^unknown ratio level 'row'; known: token, turn, sequence$"):
        segment_ids(mask, turns, "row")


def test_keep_items_cuts_strictly_below_the_threshold_with_weights_and_stable_ties():
    assert keep_items(t64([0.5, 0.1]), t64([1.0, 1.0]), 0.3).tolist() == [False, True]  # 0.3 is not below 0.3
    assert keep_items(t64([0.5, 0.1]), t64([1.0, 1.0]), 0.30001).tolist() == [True, True]
    assert keep_items(t64([0.0, 1.0]), t64([3.0, 1.0]), 0.3).tolist() == [True, True]  # (0 * 3 + 1) / 4
    assert keep_items(t64([0.0, 1.0]), t64([1.0, 1.0]), 0.3).tolist() == [True, False]
    assert keep_items(t64([1.0, 2.0, 3.0]), t64([1.0, 1.0, 1.0]), 0.1).tolist() == [True, False, False]
    # ties: the first in order goes first (tail means 0.6, 0.5, 0.33)
    assert keep_items(t64([1.0, 1.0, 1.0, 0.0, 0.0]), torch.ones(5, dtype=F64), 0.45).tolist() == \
        [False, False, True, True, True]
    assert keep_items(t64([0.2]), t64([1.0]), 0.1).tolist() == [True]
    # fractional weights: (0.25 + 0.2) / 0.5 = 0.9 is not below 0.85, 0.8 is
    assert keep_items(t64([1.0, 0.8]), t64([0.25, 0.25]), 0.85).tolist() == [False, True]
    empty = keep_items(t64([]), t64([]), 0.1)
    assert empty.tolist() == [] and empty.dtype == torch.bool


def test_m2po_keep_mask_weighs_turn_segments_by_their_tokens():
    mask = torch.tensor([[True, True, False, True]])
    turns = torch.tensor([[0, 0, -1, 1]])
    log_ratio = t64([[0.4, 0.4, 9.0, 0.1]])  # level log-ratios: turn 0 (2 tokens) at 0.4, turn 1 at 0.1
    keep, moment = m2po_keep_mask(log_ratio, mask, turns, "turn", threshold=0.1)
    assert moment.item() == pytest.approx((2 * 0.16 + 0.01) / 3)
    assert keep.tolist() == [[False, False, False, True]]
    keep, _ = m2po_keep_mask(log_ratio, mask, turns, "turn", threshold=0.12)  # 0.11 is below
    assert keep.tolist() == [[True, True, False, True]]


def test_m2po_keep_mask_over_two_ranks_with_the_collective_faked(monkeypatch):
    """This process is rank 1; rank 0 holds two segments (0.04, 1 token) and (0.0, 2 tokens)."""
    rank0 = t64([[0.04, 1.0], [0.0, 2.0]])
    sent = []

    def all_reduce_sum(value):
        sent.append(value.clone())
        value = value.clone()
        if value.ndim == 1:
            value[0] += rank0.shape[0]
        else:
            value[:rank0.shape[0]] += rank0
        return value

    monkeypatch.setattr(second_moment_module, "world_size", lambda: 2)
    monkeypatch.setattr(second_moment_module, "rank", lambda: 1)
    monkeypatch.setattr(second_moment_module, "all_reduce_sum", all_reduce_sum)
    mask = torch.tensor([[True, True, True]])
    keep, moment = m2po_keep_mask(t64([[0.1, 0.5, 0.0]]), mask, torch.zeros(1, 3, dtype=torch.long), "token", 0.045)
    # all five: 0.04, 0 (weights 1, 2) and 0.01, 0.25, 0: mean 0.05; without 0.25: 0.01
    assert moment.item() == pytest.approx(0.05)
    assert keep.tolist() == [[True, False, True]]
    assert sent[0].tolist() == [0.0, 3.0]  # this rank's row count at its own index
    torch.testing.assert_close(sent[1], t64([[0.0, 0.0], [0.0, 0.0], [0.01, 1.0], [0.25, 1.0], [0.0, 1.0]]))


def test_m2po_keep_masks_over_micro_batches_of_different_lengths_cut_as_one_batch():
    first = (t64([[0.6, 0.1, 0.0]]), torch.tensor([[True, True, False]]), torch.tensor([[0, 0, -1]]))
    second = (t64([[0.2, 0.3], [0.0, 0.05]]), torch.tensor([[True, True], [False, True]]),
              torch.tensor([[0, 1], [-1, 0]]))
    masks, moment = m2po_keep_masks([first[0], second[0]], [first[1], second[1]], [first[2], second[2]], "token",
                                    0.04)
    # squares 0.36, 0.01, 0.04, 0.09, 0.0025: mean 0.1005; without 0.36: 0.0356 < 0.04
    assert moment.item() == pytest.approx(0.5025 / 5)
    assert [m.shape for m in masks] == [(1, 3), (2, 2)]
    assert masks[0].tolist() == [[False, True, False]]
    assert masks[1].tolist() == [[True, True], [False, True]]
    whole = m2po_whole_batch(logprobs=[first[0], second[0]], old_logprobs=[torch.zeros(1, 3, dtype=F64),
                                                                            torch.zeros(2, 2, dtype=F64)],
                             loss_mask=[first[1], second[1]], turn_ids=[first[2], second[2]],
                             config=AlgorithmConfig(m2_threshold=0.04))
    assert [w["keep"].tolist() for w in whole] == [m.tolist() for m in masks]
    assert whole[1]["second_moment"].item() == pytest.approx(0.5025 / 5)


# --- config ---------------------------------------------------------------------------------------------------

import dataclasses  # noqa: E402

from stppo_agent.algorithms.config import ALGORITHMS, register_algorithm  # noqa: E402

DEFAULTS = {
    "name": "custom", "advantage": "gae", "policy_loss": "ppo_clip", "ratio_level": "token",
    "clip_bias_correction": False, "clip_bias_kappa": 1.0, "clip_bias_order": "before_grad_clip", "clip_low": 0.2,
    "clip_high": 0.2, "clip_ratio_c": None,
    "loss_agg": "token-mean", "loss_scale_factor": 1024.0, "tau_pos": 1.0, "tau_neg": 1.05, "is_cap": 20.0,
    "m2_threshold": 0.04, "dynamic_sampling": False, "max_resample_rounds": 10, "gamma": 1.0, "lam": 1.0,
    "whiten_advantages": True, "grpo_std_normalize": True, "use_critic": True, "value_clip": 0.5,
    "kl_in_reward": 0.0, "kl_loss_coef": 0.0, "kl_estimator": "low_var_kl", "entropy_coef": 0.0,
    "rollout_correction": "auto", "rollout_correction_level": "auto", "rollout_correction_cap": 2.0,
    "hyperparameters": (),
}
_GRPO_DIFF = {"advantage": "grpo", "use_critic": False, "kl_estimator": "k3"}
PRESETS = {  # each preset's fields that differ from the defaults (docs/algorithms.md, "Named algorithms")
    "ppo": {"kl_in_reward": 0.001},
    "turn_ppo": {"ratio_level": "turn", "kl_in_reward": 0.001},
    "s_ppo": {"clip_bias_correction": True, "kl_in_reward": 0.001},
    "st_ppo": {"ratio_level": "turn", "clip_bias_correction": True, "kl_in_reward": 0.001},
    "grpo": {**_GRPO_DIFF, "kl_loss_coef": 0.001},
    "gspo": {**_GRPO_DIFF, "ratio_level": "sequence", "clip_low": 3e-4, "clip_high": 4e-4,
             "loss_agg": "seq-mean-token-mean"},
    "so_grpo": {**_GRPO_DIFF, "ratio_level": "turn", "clip_bias_correction": True, "kl_loss_coef": 0.001},
    "turn_gae": {"advantage": "turn_gae", "ratio_level": "turn", "kl_in_reward": 0.001},
    "cispo": {**_GRPO_DIFF, "policy_loss": "cispo", "clip_low": 1.0},
    "sapo": {**_GRPO_DIFF, "policy_loss": "sapo", "loss_agg": "seq-mean-token-mean"},
    "gmpo": {**_GRPO_DIFF, "policy_loss": "gmpo", "ratio_level": "sequence", "clip_low": 0.4, "clip_high": 0.4,
             "loss_agg": "seq-mean-token-mean"},
    "dppo_tv": {**_GRPO_DIFF, "policy_loss": "dppo_tv", "clip_low": 0.15, "clip_high": 0.15, "is_cap": 1e4},
    "dppo_kl": {**_GRPO_DIFF, "policy_loss": "dppo_kl", "clip_low": 0.05, "clip_high": 0.05, "is_cap": 1e4},
    "m2po": {**_GRPO_DIFF, "policy_loss": "m2po"},
    "dr_grpo": {**_GRPO_DIFF, "loss_agg": "seq-mean-token-sum-norm", "grpo_std_normalize": False},
    "dapo": {**_GRPO_DIFF, "clip_high": 0.28, "dynamic_sampling": True},
}


def test_algorithm_config_defaults():
    assert dataclasses.asdict(AlgorithmConfig()) == DEFAULTS


def test_every_preset_differs_from_the_defaults_exactly_as_the_table_says():
    assert list(ALGORITHMS) == list(PRESETS)
    for name, diff in PRESETS.items():
        fields = dataclasses.asdict(ALGORITHMS[name])
        assert fields["name"] == name
        assert {k: v for k, v in fields.items() if k != "name" and v != DEFAULTS[k]} == diff, name


@pytest.mark.parametrize("field, bad, message", [
    ("ratio_level", "word", "^ratio_level must be one of token, turn, sequence; got 'word'$"),
    ("loss_agg", "sum", "^loss_agg must be one of token-mean, seq-mean-token-mean, seq-mean-token-sum-norm; "
                        "got 'sum'$"),
    ("kl_estimator", "k4", "^kl_estimator must be one of k1, k2, k3, low_var_kl; got 'k4'$"),
    ("rollout_correction", "is", "^rollout_correction must be one of auto, none, tis, mis; got 'is'$"),
    ("rollout_correction_level", "row", "^rollout_correction_level must be one of auto, token, turn, sequence; "
                                        "got 'row'$"),
    ("rollout_correction_cap", 0.99, "^rollout_correction_cap must be >= 1, got 0.99$"),
    ("clip_low", 1.01, r"^need 0 <= clip_low <= 1 and clip_high >= 0, got 1.01, 0.2$"),
    ("clip_low", -0.01, "clip_low"),
    ("clip_high", -0.01, r"^need 0 <= clip_low <= 1 and clip_high >= 0, got 0.2, -0.01$"),
    ("loss_scale_factor", 0.0, "^loss_scale_factor must be > 0, got 0.0$"),
    ("tau_pos", 0.0, "^tau_pos must be > 0, got 0.0$"),
    ("tau_neg", -1.0, "^tau_neg must be > 0, got -1.0$"),
    ("is_cap", 0.0, "^is_cap must be > 0, got 0.0$"),
    ("m2_threshold", 0.0, "^m2_threshold must be > 0, got 0.0$"),
    ("max_resample_rounds", -1, "^max_resample_rounds must be >= 0, got -1$"),
    ("clip_bias_kappa", 0.0, "^clip_bias_kappa must be > 0, got 0.0$"),
    ("gamma", 1.01, r"^gamma and lam must be in \[0, 1\], got 1.01, 1.0$"),
    ("gamma", -0.1, "gamma and lam"),
    ("lam", 1.5, r"^gamma and lam must be in \[0, 1\], got 1.0, 1.5$"),
    ("lam", -0.5, "gamma and lam"),
])
def test_algorithm_config_refuses_bad_values(field, bad, message):
    with pytest.raises(ValueError, match=message):
        AlgorithmConfig(**{field: bad})


def test_algorithm_config_accepts_the_boundaries():
    config = AlgorithmConfig(clip_low=0.0, clip_high=0.0, rollout_correction_cap=1.0, max_resample_rounds=0,
                             gamma=0.0, lam=0.0, clip_bias_kappa=1e-9, loss_scale_factor=1e-9, tau_pos=1e-9,
                             tau_neg=1e-9, is_cap=1e-9, m2_threshold=1e-9)
    assert config.clip_low == 0.0 and config.max_resample_rounds == 0
    assert AlgorithmConfig(clip_low=0.999, gamma=1.0, lam=1.0).clip_low == 0.999
    for level in ("token", "turn", "sequence"):
        assert AlgorithmConfig(ratio_level=level, rollout_correction_level=level).ratio_level == level
    for correction in ("auto", "none", "tis", "mis"):
        assert AlgorithmConfig(rollout_correction=correction).rollout_correction == correction
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert AlgorithmConfig(loss_agg=agg).loss_agg == agg
    for estimator in ("k1", "k2", "k3", "low_var_kl"):
        assert AlgorithmConfig(kl_estimator=estimator).kl_estimator == estimator


def test_register_algorithm_adds_a_preset_under_its_name():
    mine = AlgorithmConfig(name="pin_algo", clip_high=0.3)
    try:
        assert register_algorithm(mine) is mine and ALGORITHMS["pin_algo"] is mine
        with pytest.raises(ValueError, match="^algorithm 'pin_algo' is already registered"):
            register_algorithm(mine)
    finally:
        ALGORITHMS._items.pop("pin_algo", None)


# --- dynamic_sampling, metrics, registry ----------------------------------------------------------------------

from stppo_agent.algorithms.dynamic_sampling import dropped_group_count, informative_groups  # noqa: E402
from stppo_agent.algorithms.metrics import Extreme, LossMetrics, Summed, ratio_of_sums  # noqa: E402
from stppo_agent.algorithms.registry import Registry  # noqa: E402


def test_informative_groups_by_spread_and_tolerance():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.7, 2.0])
    groups = torch.tensor([3, 3, 8, 8, 5, 5, 6])
    assert informative_groups(rewards, groups).tolist() == [False, False, True, True, True, True, False]
    assert informative_groups(rewards, groups, tolerance=0.2).tolist() == [False] * 2 + [True] * 2 + [False] * 3
    assert informative_groups(rewards, groups, tolerance=0.19).tolist()[4:6] == [True, True]
    exact = informative_groups(t64([0.0, 0.5, 0.0, 0.25]), torch.tensor([0, 0, 1, 1]), tolerance=0.25)
    assert exact.tolist() == [True, True, False, False]  # a spread equal to the tolerance is not above it
    keep = informative_groups(rewards, groups)
    assert dropped_group_count(keep, groups) == 2
    assert dropped_group_count(torch.ones(7, dtype=torch.bool), groups) == 0
    ints = informative_groups(torch.tensor([1, 2, 2, 2]), torch.tensor([0, 0, 1, 1]))
    assert ints.tolist() == [True, True, False, False]
    empty = informative_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,)
    # float64 spreads below float32's resolution still count
    assert informative_groups(t64([1.0, 1.0 + 1e-12]), torch.tensor([0, 0])).tolist() == [True, True]


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


def test_registry_names_errors_and_listing():
    registry = Registry("widget")
    assert registry.register("b", 2) == 2
    assert registry.decorator("a")(1) == 1
    assert list(registry) == ["b", "a"] and len(registry) == 2 and registry["a"] == 1
    assert repr(registry) == "Registry(widget: a, b)"
    with pytest.raises(KeyError, match="unknown widget 'c'; known: a, b"):
        registry["c"]
    with pytest.raises(ValueError, match="^widget 'a' is already registered; choose another name$"):
        registry.register("a", 3)
    with pytest.raises(ValueError, match="^widget names must be non-empty strings, got ''$"):
        registry.register("", 3)
    with pytest.raises(ValueError, match="^widget names must be non-empty strings, got 5$"):
        registry.register(5, 3)
    assert registry["a"] == 1


# --- rollout_correction -----------------------------------------------------------------------------------------

from stppo_agent.algorithms.rollout_correction import (  # noqa: E402
    resolve_rollout_correction,
    rollout_correction_weights,
)


def test_resolve_rollout_correction_auto_per_backend_and_level():
    turn = AlgorithmConfig(ratio_level="turn")
    resolved = resolve_rollout_correction(turn, "vllm")
    assert (resolved.rollout_correction, resolved.rollout_correction_level) == ("tis", "turn")
    resolved = resolve_rollout_correction(AlgorithmConfig(ratio_level="sequence"), "transformers")
    assert (resolved.rollout_correction, resolved.rollout_correction_level) == ("none", "token")
    explicit = AlgorithmConfig(rollout_correction="mis", rollout_correction_level="sequence")
    resolved = resolve_rollout_correction(explicit, "vllm")
    assert (resolved.rollout_correction, resolved.rollout_correction_level) == ("mis", "sequence")
    assert resolve_rollout_correction(turn, "transformers").ratio_level == "turn"


def _correction(correction, level="token", cap=2.0):
    mask = torch.tensor([[True, True, False, True], [True, False, False, False]])
    turns = torch.tensor([[0, 0, -1, 1], [0, -1, -1, -1]])
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-2.0, 0.0, 0.0, 0.0]])
    # token weights exp(old - sample): 3, 0.5, (masked: e^30), 2 (at the cap), 1
    sample = old - torch.tensor([[math.log(3.0), math.log(0.5), 30.0, math.log(2.0)], [0.0, 5.0, 5.0, 5.0]])
    config = AlgorithmConfig(rollout_correction=correction, rollout_correction_level=level,
                             rollout_correction_cap=cap)
    return rollout_correction_weights(old, sample, mask, turns, config), mask


def test_rollout_correction_metrics_and_the_tis_cap():
    (weights, metrics), _ = _correction("tis")
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]]))
    logs = [math.log(3.0), math.log(0.5), math.log(2.0), 0.0]
    assert metrics["rollout_logprob_diff"] == pytest.approx(sum(abs(x) for x in logs) / 4, rel=1e-5)
    assert metrics["rollout_correction/kl"] == pytest.approx(sum(math.expm1(x) - x for x in logs) / 4, rel=1e-5)
    assert metrics["rollout_correction/weight_mean"] == pytest.approx(6.5 / 4, rel=1e-5)
    assert metrics["rollout_correction/weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert metrics["rollout_correction/weight_p99"] == pytest.approx(2.0 + 0.97 * 1.0, rel=1e-4)
    assert metrics["rollout_correction/truncated_frac"] == pytest.approx(0.25)  # 2 at the cap is not above it
    assert "rollout_correction/masked_frac" not in metrics


def test_rollout_correction_mis_masks_above_the_cap_and_none_only_measures():
    (weights, metrics), _ = _correction("mis")
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.5, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]]))
    assert metrics["rollout_correction/masked_frac"] == pytest.approx(0.25)
    assert "rollout_correction/truncated_frac" not in metrics
    (weights, metrics), _ = _correction("none")
    assert weights is None and metrics["rollout_correction/weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert not any(key.endswith("_frac") for key in metrics)
    (weights, metrics), _ = _correction("tis", cap=4.0)
    torch.testing.assert_close(weights, torch.tensor([[3.0, 0.5, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]]))
    assert metrics["rollout_correction/truncated_frac"] == 0.0


def test_rollout_correction_at_turn_and_sequence_level_uses_geometric_means():
    (weights, metrics), _ = _correction("tis", level="turn", cap=10.0)
    g = math.sqrt(1.5)  # turn 0 of row 0: sqrt(3 * 0.5)
    torch.testing.assert_close(weights, torch.tensor([[g, g, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]]))
    assert metrics["rollout_correction/weight_max"] == pytest.approx(2.0, rel=1e-5)
    # the token-level mismatch metrics do not depend on the level
    assert metrics["rollout_correction/kl"] == pytest.approx(
        sum(math.expm1(x) - x for x in [math.log(3.0), math.log(0.5), math.log(2.0), 0.0]) / 4, rel=1e-5)
    (weights, _), _ = _correction("mis", level="sequence", cap=1.5)
    row0 = 3.0 ** (1 / 3)  # (3 * 0.5 * 2) ** (1 / 3) = 1.44 <= 1.5
    torch.testing.assert_close(weights, torch.tensor([[row0, row0, 0.0, row0], [1.0, 0.0, 0.0, 0.0]]))


def test_rollout_correction_refuses_auto_and_weighs_a_batch_without_policy_tokens_zero():
    with pytest.raises(ValueError, match="^rollout_correction is 'auto': resolve it for the generation backend "
                                         r"first \(resolve_rollout_correction\)$"):
        rollout_correction_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                                   torch.zeros(1, 2, dtype=torch.long),
                                   AlgorithmConfig(rollout_correction_level="token"))
    with pytest.raises(ValueError, match="auto"):
        rollout_correction_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                                   torch.zeros(1, 2, dtype=torch.long), AlgorithmConfig(rollout_correction="tis"))
    config = AlgorithmConfig(rollout_correction="tis", rollout_correction_level="token")
    weights, metrics = rollout_correction_weights(torch.zeros(1, 2), torch.ones(1, 2),
                                                  torch.zeros(1, 2, dtype=torch.bool),
                                                  torch.zeros(1, 2, dtype=torch.long), config)
    assert torch.equal(weights, torch.zeros(1, 2)) and metrics == {}  # zero weights, so that shares merge


def test_rollout_correction_clamps_the_log_weight_at_20():
    config = AlgorithmConfig(rollout_correction="none", rollout_correction_level="token")
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, metrics = rollout_correction_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[-30.0, 0.0]]), mask,
                                            torch.zeros(1, 2, dtype=torch.long), config)
    assert metrics["rollout_correction/weight_max"] == pytest.approx(math.exp(20.0), rel=1e-5)
    assert metrics["rollout_correction/kl"] == pytest.approx((math.expm1(20.0) - 20.0) / 2, rel=1e-5)
    assert metrics["rollout_logprob_diff"] == pytest.approx(15.0)  # the raw difference, not clamped


def test_stabilisers_clamp_the_level_log_ratio_keep_the_models_dtype_and_take_the_global_normalisers():
    mask = torch.tensor([[True, True, True]])
    logprobs = torch.tensor([[30.0, -30.0, 0.0]], requires_grad=True)
    advantages = t64([[1.0, -1.0, 0.5]])
    config = AlgorithmConfig(m2_threshold=1e6)
    loss, _, metrics = get_policy_loss("m2po")(logprobs=logprobs, old_logprobs=torch.zeros(1, 3), advantages=advantages,
                                                loss_mask=mask, turn_ids=torch.zeros(1, 3, dtype=torch.long),
                                                config=config)
    assert loss.dtype == torch.float32  # float64 advantages do not promote the loss
    assert metrics["ratio/max"].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert metrics["ratio/min"].item() == pytest.approx(math.exp(-20.0), rel=1e-5)
    assert loss.item() == pytest.approx(-(math.exp(20.0) - math.exp(-20.0) + 0.5) / 3, rel=1e-5)
    assert metrics["pg_loss"].item() == pytest.approx(loss.item())
    assert metrics.parts["pg_loss"].sums[1].item() == 3.0
    kwargs = dict(logprobs=logprobs.detach().double() * 0.01, old_logprobs=torch.zeros(1, 3, dtype=F64),
                  advantages=advantages, loss_mask=mask, turn_ids=torch.zeros(1, 3, dtype=torch.long))
    for name in ("cispo", "m2po"):
        rule = get_policy_loss(name)
        own = rule(config=config, **kwargs)[0]
        assert rule(config=config, global_num_tokens=6, global_num_seqs=1, **kwargs)[0].item() == \
            pytest.approx(own.item() / 2)
        seq = dataclasses.replace(config, loss_agg="seq-mean-token-mean")
        assert rule(config=seq, global_num_tokens=1, global_num_seqs=4, **kwargs)[0].item() == \
            pytest.approx(rule(config=seq, **kwargs)[0].item() / 4)


def _dppo_edges(rule, config):
    """Token 0: p 0.5 -> 1 (A > 0); token 1: p 1 -> 0.5 (A < 0); token 2: p 0.25 -> 1 (A = 0)."""
    old = t64([[math.log(0.5), 0.0, math.log(0.25)]])
    logprobs = t64([[0.0, math.log(0.5), 0.0]]).requires_grad_(True)
    return get_policy_loss(rule)(logprobs=logprobs, old_logprobs=old, advantages=t64([[1.0, -1.0, 0.0]]),
                                 loss_mask=torch.ones(1, 3, dtype=torch.bool),
                                 turn_ids=torch.tensor([[0, 1, 2]]), config=config)


def test_dppo_tv_keeps_a_move_equal_to_the_threshold_and_reads_a_zero_advantage_as_negative():
    # ratios 2, 0.5, 4: a ratio equal to the cap is not truncated
    _, bias, metrics = _dppo_edges("dppo_tv", AlgorithmConfig(clip_low=0.5, clip_high=0.5, is_cap=4.0))
    assert metrics["clip_frac"].item() == 0.0 and not bias.requires_grad
    _, _, metrics = _dppo_edges("dppo_tv", AlgorithmConfig(clip_low=0.5, clip_high=0.5, is_cap=3.99))
    assert metrics["clip_frac"].item() == pytest.approx(1 / 3)
    _, _, metrics = _dppo_edges("dppo_tv", AlgorithmConfig(clip_low=0.49, clip_high=0.49))
    assert metrics["clip_frac"].item() == pytest.approx(2 / 3)  # token 2 stays: A = 0 takes the lower bound


def test_dppo_kl_at_certain_tokens_and_at_the_threshold():
    # p = 1 on either side: the 1e-8 keeps the Bernoulli KL finite (0.69 and 8.5; token 2: 13.2)
    _, bias, metrics = _dppo_edges("dppo_kl", AlgorithmConfig(clip_low=0.9, clip_high=9.0))
    assert metrics["clip_frac"].item() == 0.0 and not bias.requires_grad
    old_p, new_p = t64([0.5, 1.0]), t64([1.0, 0.5])
    old_log, new_log = torch.log(old_p), torch.log(new_p)
    kl = old_p * (old_log - new_log) + (1 - old_p) * torch.log((1 - old_p + 1e-8) / (1 - new_p + 1e-8))
    assert kl[0].item() == pytest.approx(0.5 * math.log(0.5) + 0.5 * math.log(0.5e8))
    _, _, metrics = _dppo_edges("dppo_kl", AlgorithmConfig(clip_low=kl[1].item(), clip_high=kl[0].item()))
    assert metrics["clip_frac"].item() == 0.0  # a KL equal to the threshold is kept
    _, _, metrics = _dppo_edges("dppo_kl", AlgorithmConfig(clip_low=0.5, clip_high=8.0))
    assert metrics["clip_frac"].item() == pytest.approx(2 / 3)


@pytest.mark.parametrize("rule", ["cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "m2po"])
def test_every_stabiliser_adds_the_kl_and_entropy_terms_and_takes_the_global_normalisers(rule):
    config = AlgorithmConfig(clip_low=0.1, clip_high=0.3, kl_loss_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    logprobs, old, advantages, mask, turns = _ratio_batch()
    kwargs = dict(logprobs=logprobs, old_logprobs=old, advantages=advantages, loss_mask=mask, turn_ids=turns)
    ref_logprobs = logprobs.detach() - t64([[1.0, 2.0, 3.0], [4.0, 50.0, 5.0]])
    entropy = t64([[1.0, 1.0, 1.0], [2.0, 90.0, 5.0]])
    loss, _, metrics = get_policy_loss(rule)(config=config, ref_logprobs=ref_logprobs, entropy=entropy, **kwargs)
    assert metrics["kl_loss"].item() == pytest.approx(3.0) and metrics["entropy"].item() == pytest.approx(2.0)
    assert loss.item() == pytest.approx(metrics["pg_loss"].item() + 0.5 * 3.0 - 0.1 * 2.0)
    plain = get_policy_loss(rule)(config=config, **kwargs)[0]
    (plain_grad,) = torch.autograd.grad(plain, logprobs)
    (full_grad,) = torch.autograd.grad(get_policy_loss(rule)(config=config, ref_logprobs=ref_logprobs,
                                                             entropy=entropy, **kwargs)[0], logprobs)
    torch.testing.assert_close(full_grad - plain_grad, mask.to(F64) * 0.5 / 5)  # the k1 term's gradient
    halved = get_policy_loss(rule)(config=config, global_num_tokens=10, **kwargs)[0]
    assert halved.item() == pytest.approx(plain.item() / 2)
    seq = dataclasses.replace(config, loss_agg="seq-mean-token-mean")
    quarter = get_policy_loss(rule)(config=seq, global_num_seqs=8, **kwargs)[0]
    assert quarter.item() == pytest.approx(get_policy_loss(rule)(config=seq, **kwargs)[0].item() / 4)


def test_sorts_are_stable_on_long_rows():
    """Long enough rows that an unstable sort reorders: policy tokens keep their order (GAE runs over them) and
    M2PO drops tied segments first-come (every rank makes the same cut)."""
    generator = torch.Generator().manual_seed(5)
    mask = torch.rand(3, 60, generator=generator) < 0.5
    order = compact_policy_positions(mask)
    for row in range(3):
        policy = torch.nonzero(mask[row]).flatten().tolist()
        rest = torch.nonzero(~mask[row]).flatten().tolist()
        assert order[row].tolist() == policy + rest
    values = torch.ones(60, dtype=F64)
    values[::3] = 0.0  # 40 tied ones, 20 zeros: (40 - k) / (60 - k) < 0.5 once k = 21 ones are gone
    keep = keep_items(values, torch.ones(60, dtype=F64), 0.5)
    ones = torch.nonzero(values == 1.0).flatten()
    assert keep[ones[:21]].tolist() == [False] * 21 and keep[ones[21:]].all() and keep[values == 0.0].all()


# the one costly pin (a 16M-value sort) last: under mutation testing -x stops before it for most mutants
def test_quantile_past_torchs_input_limit_subsamples_keeping_both_tails(monkeypatch):
    seen = []

    def limited_quantile(values, q):  # torch.quantile's own refusal, without its cost on 16M values
        seen.append(values)
        if values.numel() > 1 << 24:
            raise RuntimeError("quantile() input tensor is too large")
        return values.max() if q == 1.0 else values.min()

    monkeypatch.setattr(torch, "quantile", limited_quantile)
    big = torch.zeros((1 << 24) + 1, dtype=torch.float32)
    big[0], big[-1] = 7.0, -5.0
    assert quantile(big, 1.0) == 7.0
    assert seen[-1].numel() == 1 << 24 and seen[-1].dtype == F64
    assert seen[-1][0].item() == -5.0 and seen[-1][-1].item() == 7.0  # sorted, both ends kept
