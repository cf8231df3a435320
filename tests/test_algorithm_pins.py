"""The algorithms' math pinned by value where `make mutants` found mutants every other test let through."""

from __future__ import annotations

import math

import pytest
import torch

from stppo_agent.algorithms import AlgorithmConfig, explained_variance, get_policy_loss, kl_estimate, value_loss

from . import algorithm_reference as ref
from .test_algorithms import random_batch


@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_turn_clip_fraction_is_the_share_of_turns_whose_mean_ratio_left_the_range(seed, level):
    data = random_batch(seed, torch.float64, spread=0.4)
    config = AlgorithmConfig(ratio_level=level, clip_low=0.2, clip_high=0.28)
    _, _, metrics = get_policy_loss("ppo_clip")(
        logprobs=data["logprobs"], old_logprobs=data["old"], advantages=data["advantages"], loss_mask=data["mask"],
        turn_ids=data["turns"], config=config)
    turn_log_ratio = ref.ref_log_ratio(data["logprobs"], data["old"], data["mask"], data["turns"], "turn")
    outside, turns = 0, 0
    for b in range(data["mask"].shape[0]):
        seen = set()
        for t in torch.nonzero(data["mask"][b]).flatten().tolist():
            turn = int(data["turns"][b, t])
            if turn in seen:
                continue
            seen.add(turn)
            ratio = math.exp(float(turn_log_ratio[b, t]))
            turns += 1
            outside += ratio > 1.28 or ratio < 0.8
    assert 0 < outside < turns  # the case means something
    assert float(metrics["turn_clip_frac"]) == pytest.approx(outside / turns)


def test_kl_estimators_clamp_where_verl_does():
    zero = torch.tensor([0.0], dtype=torch.float64)
    # k3 / low_var_kl clamp l = logp - ref to [-20, 20] before the exponential
    assert kl_estimate(torch.tensor([30.0], dtype=torch.float64), zero, "k3").item() == pytest.approx(
        math.exp(-20) - 1 + 20)
    # low_var_kl is k3 clamped to [-10, 10]: equal to k3 below 10
    small = torch.tensor([-0.7], dtype=torch.float64)
    assert kl_estimate(small, zero, "low_var_kl").item() == pytest.approx(math.exp(0.7) - 1 - 0.7)


def test_value_loss_normalises_by_the_global_token_count():
    values = torch.tensor([[0.5, 1.0, 0.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, False]])
    config = AlgorithmConfig(value_clip=10.0)
    loss, _ = value_loss(values=values, old_values=values.detach(), returns=returns, loss_mask=mask, config=config,
                         global_num_tokens=torch.tensor(8.0))
    assert loss.item() == pytest.approx(0.5 * 0.25 / 8)  # the micro-batch's sum over the optimizer batch's tokens


def test_explained_variance_is_zero_for_constant_targets_and_one_for_perfect_predictions():
    mask = torch.tensor([[True, True, True]])
    constant = torch.tensor([[2.0, 2.0, 2.0]])
    assert explained_variance(torch.tensor([[1.0, 3.0, 2.0]]), constant, mask).item() == 0.0
    targets = torch.tensor([[1.0, 2.0, 4.0]])
    assert explained_variance(targets, targets, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.zeros_like(targets), targets, mask).item() == pytest.approx(0.0)


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
