"""algorithm.clip_ratio_c, the dual clip of the ppo_clip loss (verl's clip_ratio_c): for A < 0 a ratio above c
contributes the constant -c * A, at every ratio level; the rho * A it gave up is part of the clipping bias C."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from stppo_agent.algorithms import ALGORITHMS, AlgorithmConfig, get_policy_loss
from stppo_agent.algorithms.losses import aggregate, log_ratio_at_level
from stppo_agent.training.config import load_config

from . import algorithm_reference as ref
from .test_algorithms import random_batch

LEVELS = ("token", "turn", "sequence")
SEEDS = range(6)
CLIP_C = 1.6  # inside the spread of random_batch(spread=1.0)'s ratios, so the dual clip binds on some tokens


def _loss(config, data, logprobs=None):
    theta = (data["logprobs"] if logprobs is None else logprobs).clone().requires_grad_(True)
    loss, bias, metrics = get_policy_loss("ppo_clip")(
        logprobs=theta, old_logprobs=data["old"], advantages=data["advantages"], loss_mask=data["mask"],
        turn_ids=data["turns"], config=config)
    return theta, loss, bias, metrics


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("seed", SEEDS)
def test_dual_clip_matches_a_plain_loop_at_every_ratio_level(seed, level, agg):
    data = random_batch(seed, torch.float64, spread=1.0)
    config = AlgorithmConfig(ratio_level=level, loss_agg=agg, clip_low=0.2, clip_high=0.28, clip_ratio_c=CLIP_C)
    theta, loss, bias, metrics = _loss(config, data)
    expected_theta = data["logprobs"].clone().requires_grad_(True)
    expected_loss, expected_bias, clip_frac, dual_frac = ref.ref_ppo_dual_clip(
        expected_theta, data["old"], data["advantages"], data["mask"], data["turns"], level, 0.2, 0.28, CLIP_C, agg)
    assert metrics["clip_frac"].item() == pytest.approx(clip_frac, abs=1e-12)
    assert metrics["dual_clip_frac"].item() == pytest.approx(dual_frac, abs=1e-12)
    if not torch.is_tensor(expected_loss) or not expected_loss.requires_grad:  # nothing the policy can move
        return
    (bias_grad,) = torch.autograd.grad(bias, theta, retain_graph=True) if bias.requires_grad else (None,)
    (expected_bias_grad,) = torch.autograd.grad(expected_bias, expected_theta, retain_graph=True) \
        if torch.is_tensor(expected_bias) and expected_bias.requires_grad else (None,)
    loss.backward()
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(theta.grad, expected_theta.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(bias.detach(), torch.as_tensor(expected_bias, dtype=torch.float64).detach(),
                               rtol=1e-9, atol=1e-12)
    if expected_bias_grad is None:
        assert bias_grad is None or not bias_grad.any()
    else:
        torch.testing.assert_close(bias_grad, expected_bias_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("level", LEVELS)
def test_the_reference_batches_bind_the_dual_clip_at_every_level(level):
    """The comparison above means something: its batches put ratios above c under negative advantages."""
    config = AlgorithmConfig(ratio_level=level, clip_ratio_c=CLIP_C)
    bound = [float(_loss(config, random_batch(seed, torch.float64, spread=1.0))[3]["dual_clip_frac"])
             for seed in SEEDS]
    assert sum(bound) > 0


def _one_token(ratio: float, advantage: float, clip_c: float | None):
    data = {"logprobs": torch.tensor([[math.log(ratio)]], dtype=torch.float64),
            "old": torch.zeros(1, 1, dtype=torch.float64),
            "advantages": torch.tensor([[advantage]], dtype=torch.float64),
            "mask": torch.ones(1, 1, dtype=torch.bool), "turns": torch.zeros(1, 1, dtype=torch.long)}
    theta, loss, bias, metrics = _loss(AlgorithmConfig(clip_ratio_c=clip_c), data)
    loss_grad = torch.autograd.grad(loss, theta, retain_graph=True)[0].item() if loss.requires_grad else 0.0
    bias_grad = torch.autograd.grad(bias, theta)[0].item() if bias.requires_grad else 0.0
    return loss.item(), loss_grad, bias.item(), bias_grad, metrics


def test_past_c_a_negative_advantage_token_costs_c_times_its_advantage_and_its_gradient_moves_into_c():
    # rho 4, A -1: PPO keeps the unclipped branch, loss rho * |A| = 4, gradient d(4)/d log pi = 4, nothing clipped
    assert _one_token(4.0, -1.0, None)[:4] == pytest.approx((4.0, 4.0, 0.0, 0.0))
    # with c = 3 the loss is the constant 3 (no gradient) and C takes rho * A = -4, gradient -4
    loss, loss_grad, bias, bias_grad, metrics = _one_token(4.0, -1.0, 3.0)
    assert (loss, loss_grad, bias, bias_grad) == pytest.approx((3.0, 0.0, -4.0, -4.0))
    assert metrics["dual_clip_frac"].item() == 1.0 and metrics["clip_frac"].item() == 1.0
    # just below c, and for a positive advantage at any ratio, the dual clip changes nothing
    assert _one_token(2.9, -1.0, 3.0)[:4] == pytest.approx(_one_token(2.9, -1.0, None)[:4])
    assert _one_token(2.9, -1.0, 3.0)[4]["dual_clip_frac"].item() == 0.0
    assert _one_token(4.0, 1.0, 3.0)[:4] == pytest.approx(_one_token(4.0, 1.0, None)[:4])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("seed", SEEDS)
def test_the_bias_is_what_the_dual_clipped_loss_took_from_importance_sampling(seed, level):
    """grad(bias) = grad agg(rho A) + grad pg_loss with the dual clip on: the clipped-away rho A of a dual-clipped
    token is in C, so the clip-bias correction sees it."""
    data = random_batch(seed, torch.float64, spread=1.0)
    config = AlgorithmConfig(ratio_level=level, clip_ratio_c=CLIP_C)
    theta, loss, bias, _ = _loss(config, data)
    mask = data["mask"]
    if not bool(mask.any()):
        return
    ratio = torch.exp(log_ratio_at_level(theta, data["old"], mask, data["turns"], level))
    importance = aggregate(ratio * data["advantages"], mask, config.loss_agg)
    expected = torch.autograd.grad(importance + loss, theta, retain_graph=True)[0]
    got = torch.autograd.grad(bias, theta)[0] if bias.requires_grad else torch.zeros_like(expected)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_clip_ratio_c_is_off_by_default_checked_and_recorded(tmp_path):
    assert all(preset.clip_ratio_c is None for preset in ALGORITHMS.values())
    with pytest.raises(ValueError, match=r"^clip_ratio_c must be > 1 \(or unset\), got 1.0$"):
        AlgorithmConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="policy_loss cispo has a trust region of its own and does not read it"):
        dataclasses.replace(ALGORITHMS["cispo"], clip_ratio_c=3.0)
    config = load_config(None, ["algorithm.clip_ratio_c=3", "model=m", "env=stppo/Toy-v0"], algo="st_ppo")
    assert config.algorithm_config().clip_ratio_c == 3.0
    assert "clip_ratio_c: 3.0" in config.to_yaml(resolved=config.algorithm_config())
