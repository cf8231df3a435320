"""``stppo_agent.algorithms.losses``: the log-ratio at each level, the aggregation modes,
KL estimators with verl's clamps, the ppo_clip loss by hand (its clipped set, bias, metrics, boundaries and the
dual clip), the value loss, explained variance, and the device every loss is computed on."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from stppo_agent.algorithms import losses as losses_module
from stppo_agent.algorithms.config import ALGORITHMS, AlgorithmConfig
from stppo_agent.algorithms.losses import (
    aggregate,
    aggregate_parts,
    aggregation_kwargs,
    explained_variance,
    get_policy_loss,
    kl_estimate,
    kl_reward_penalty,
    log_ratio_at_level,
    value_loss,
)
from stppo_agent.training.config import load_config
from tests.support import algorithm_reference as ref
from tests.support.batches import F64, _ratio_batch, random_batch, t64
from tests.support.devices import _policy_batch


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


# algorithm.clip_ratio_c, the dual clip of the ppo_clip loss (verl's clip_ratio_c): for A < 0 a ratio above c
# contributes the constant -c * A, at every ratio level; the rho * A it gave up is part of the clipping bias C.


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


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
@pytest.mark.parametrize("name", ["ppo_clip", "cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "m2po"])
def test_losses_are_computed_on_the_inputs_device_whatever_the_default_device(name, level, loss_agg):
    from stppo_agent.algorithms.losses import get_policy_loss

    config = AlgorithmConfig(ratio_level=level, loss_agg=loss_agg, kl_loss_coef=0.1)
    batch = _policy_batch()
    loss, _, metrics = get_policy_loss(name)(config=config, **batch)
    with torch.device("meta"):
        got, _, got_metrics = get_policy_loss(name)(config=config, **batch)
    assert got.device.type == "cpu" and got.dtype == F64
    torch.testing.assert_close(got, loss, rtol=0, atol=0)
    assert repr(got_metrics) == repr(metrics)


def test_losses_kl_reward_penalty_and_log_ratio_stay_on_the_inputs_device():
    from stppo_agent.algorithms.losses import kl_reward_penalty, log_ratio_at_level

    batch = _policy_batch()
    config = AlgorithmConfig(kl_in_reward=0.5)
    old, ref, mask = batch["old_logprobs"], batch["ref_logprobs"], batch["loss_mask"]
    with torch.device("meta"):
        penalty = kl_reward_penalty(old, ref, mask, config)
        log_ratio = log_ratio_at_level(batch["logprobs"], old, mask, batch["turn_ids"], "turn")
    torch.testing.assert_close(penalty, torch.where(mask, 0.5 * (old - ref), 0.0), rtol=0, atol=0)
    assert penalty.dtype == F64 and log_ratio.device.type == "cpu" and log_ratio.dtype == F64
    assert log_ratio[0, 0] == 0 and log_ratio[0, 1] == log_ratio[0, 2] != 0


def test_explained_variance_and_value_clip_fraction_by_hand():
    mask = torch.tensor([[True, True, True, False]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    values = torch.tensor([[1.5, 2.0, 2.0, -50.0]])
    # residuals -0.5, 0, 1 -> var (population) = mean((r - 1/6)^2); targets 1,2,3 -> var 2/3
    residual = torch.tensor([-0.5, 0.0, 1.0])
    expected = 1 - ((residual - residual.mean()) ** 2).mean() / torch.tensor(2 / 3)
    assert float(explained_variance(values, returns, mask)) == pytest.approx(float(expected))
    old_values = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    config = ALGORITHMS["ppo"].__class__(value_clip=0.2)
    _, metrics = value_loss(values=values, old_values=old_values, returns=returns, loss_mask=mask, config=config)
    # token 0: V moved 0.5 from 1.0 -> clipped to 1.2, whose error (0.2^2) < unclipped (0.5^2): max picks unclipped
    # token 1, 2: V equal to old: no clipping either way
    assert float(metrics["value_clip_frac"]) == 0.0
    values5 = torch.tensor([[1.4, 2.0, 2.0, 0.0]])  # moved 0.4 from old 1.0, beyond the clip range 0.2
    _, metrics5 = value_loss(values=values5, old_values=torch.tensor([[1.0, 2.0, 2.0, 0.0]]),
                             returns=torch.tensor([[1.5, 2.0, 3.0, 0.0]]), loss_mask=mask, config=config)
    # token 0: unclipped (1.4-1.5)^2 = 0.01, clipped (1.2-1.5)^2 = 0.09 > 0.01: clipped branch wins -> 1 of 3
    assert float(metrics5["value_clip_frac"]) == pytest.approx(1 / 3)
