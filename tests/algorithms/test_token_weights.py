"""Per-token weights of the policy loss (the rollout correction's w', DAPO's fillers at 0) act on each token's term of
every registered rule, and a weight of 0 drops the token as if it had never been sampled -- also in rules whose loss
is not a sum of per-token terms (GMPO's geometric mean, a turn- or sequence-level ratio)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from stppo_agent.algorithms import ALGORITHMS, POLICY_LOSSES, call_policy_loss, get_policy_loss
from tests.support import algorithm_reference as ref
from tests.support.batches import EXERCISE, probability_batch
from tests.support.runs import toy_config

LEVELS = ("token", "turn", "sequence")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def reference(rule, config, theta, data, mask, weights):
    """The rule's loss from its definition, one token at a time (tests/support/algorithm_reference.py), over ``mask``,
    each token's term times its weight."""
    common = (theta, data["old"], data["advantages"], mask, data["turns"], config.ratio_level)
    if rule == "ppo_clip":
        return ref.ref_ppo_clip_loss(*common, config.clip_low, config.clip_high, config.loss_agg, weights=weights)
    if rule == "cispo":
        return ref.ref_cispo(*common, config.clip_low, config.clip_high, config.loss_agg, weights=weights)
    if rule == "sapo":
        return ref.ref_sapo(*common, config.tau_pos, config.tau_neg, config.loss_agg, weights=weights)
    if rule == "gmpo":
        return ref.ref_gmpo(*common, config.clip_low, config.clip_high, config.loss_agg, weights=weights)
    if rule in ("dppo_tv", "dppo_kl"):
        return ref.ref_dppo(rule[-2:], *common, config.clip_low, config.clip_high, config.is_cap, config.loss_agg,
                            weights=weights)
    if rule == "m2po":
        return ref.ref_m2po(*common, config.m2_threshold, config.loss_agg, weights=weights)
    raise AssertionError(f"no reference for the registered rule {rule!r}: add one")


def rule_config(rule: str, level: str, agg: str):
    preset = next(p for p in ALGORITHMS.values() if p.policy_loss == rule)
    return dataclasses.replace(preset, ratio_level=level, loss_agg=agg, **EXERCISE.get(rule, {}))


def some_weights(seed: int, mask: torch.Tensor) -> torch.Tensor:
    """Weights in [0.3, 1.8] on the policy tokens, about a third of them 0 (and one token for sure)."""
    generator = torch.Generator().manual_seed(100 + seed)
    weights = 0.3 + 1.5 * torch.rand(mask.shape, generator=generator, dtype=torch.float64)
    dropped = torch.rand(mask.shape, generator=generator) < 0.35
    first = torch.nonzero(mask)
    if len(first):
        dropped[tuple(first[0])] = True
    return torch.where(mask & ~dropped, weights, 0.0)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rule", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("seed", range(4))
def test_every_rule_weights_each_tokens_term_and_drops_weight_zero_tokens(seed, rule, level, agg):
    data = probability_batch(seed, torch.float64, spread=0.4)
    config = rule_config(rule, level, agg)
    weights = some_weights(seed, data["mask"])
    theta = data["logprobs"].clone().requires_grad_(True)
    loss, _, _ = get_policy_loss(rule)(logprobs=theta, old_logprobs=data["old"], advantages=data["advantages"],
                                       loss_mask=data["mask"], turn_ids=data["turns"], config=config,
                                       token_weights=weights)
    kept = data["mask"] & (weights > 0)
    expected_theta = data["logprobs"].clone().requires_grad_(True)
    expected = reference(rule, config, expected_theta, data, kept, weights)
    if not torch.is_tensor(expected) or not expected.requires_grad:  # nothing kept: no loss, no gradient
        (grad,) = torch.autograd.grad(loss, theta, allow_unused=True, materialize_grads=True)
        assert float(loss) == pytest.approx(float(expected)) and not grad.any()
        return
    (grad,) = torch.autograd.grad(loss, theta)
    (expected_grad,) = torch.autograd.grad(expected, expected_theta)
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert not grad[data["mask"] & (weights == 0)].any()  # out of every term and every segment mean


@pytest.mark.parametrize("rule", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("level", LEVELS)
def test_weight_zero_is_the_token_truly_dropped_kl_and_entropy_included(rule, level):
    """Weights 0 / 1 give exactly the loss, and the gradients (log-probs and entropies), of the rule called on the
    batch without those tokens."""
    data = probability_batch(2, torch.float64, spread=0.4)
    config = dataclasses.replace(rule_config(rule, level, "token-mean"), kl_loss_coef=0.1, entropy_coef=0.01)
    weights = (some_weights(2, data["mask"]) > 0).double()
    generator = torch.Generator().manual_seed(5)
    ref_logprobs = data["logprobs"] + 0.2 * torch.randn(data["logprobs"].shape, generator=generator,
                                                        dtype=torch.float64)
    entropy0 = torch.rand(data["logprobs"].shape, generator=generator, dtype=torch.float64)

    def run(mask, token_weights):
        theta = data["logprobs"].clone().requires_grad_(True)
        entropy = entropy0.clone().requires_grad_(True)
        loss, _, _ = get_policy_loss(rule)(logprobs=theta, old_logprobs=data["old"], advantages=data["advantages"],
                                           loss_mask=mask, turn_ids=data["turns"], config=config,
                                           ref_logprobs=ref_logprobs, entropy=entropy, token_weights=token_weights)
        grads = torch.autograd.grad(loss, (theta, entropy), allow_unused=True, materialize_grads=True)
        return loss.detach(), grads

    weighted_loss, weighted_grads = run(data["mask"], weights)
    dropped_loss, dropped_grads = run(data["mask"] & (weights > 0), None)
    torch.testing.assert_close(weighted_loss, dropped_loss, rtol=1e-12, atol=1e-15)
    for got, expected in zip(weighted_grads, dropped_grads):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)


def test_gmpo_weight_zero_leaves_the_trajectorys_geometric_mean():
    """By hand: one trajectory, log-ratios 0.3, -0.2, 0.1 (inside GMPO's 0.4 clip), A = 1, the middle token
    weighted 0. Dropped: both kept tokens get -A exp((0.3 + 0.1) / 2), so L = -exp(0.2); folding the weight into
    its advantage instead would have clipped its log-ratio to 0 and kept it in the mean: -(2 / 3) exp(0.4 / 3)."""
    old = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    logprobs = (old + torch.tensor([[0.3, -0.2, 0.1]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, _, _ = get_policy_loss("gmpo")(
        logprobs=logprobs, old_logprobs=old, advantages=torch.ones(1, 3, dtype=torch.float64), loss_mask=mask,
        turn_ids=torch.zeros(1, 3, dtype=torch.long), config=ALGORITHMS["gmpo"],
        token_weights=torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64))
    assert float(loss.detach()) == pytest.approx(-math.exp(0.2), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert float(grad[0, 1]) == 0.0  # the dropped token moves nothing
    assert float(grad[0, 0]) == float(grad[0, 2]) == pytest.approx(-0.5 * math.exp(0.2), rel=1e-12)


def test_a_rule_of_ones_own_without_the_keyword_gets_the_weights_folded_in():
    """A registered loss written before token_weights existed: weight-0 tokens leave its mask, the others'
    advantages carry their weight; the same loss as ppo_clip taking the weights itself (linear in A)."""
    data = probability_batch(3, torch.float64, spread=0.4)
    weights = some_weights(3, data["mask"])
    config = ALGORITHMS["grpo"]
    seen = {}

    def old_style(*, logprobs, old_logprobs, advantages, loss_mask, turn_ids, config):
        seen["mask"] = loss_mask
        return get_policy_loss("ppo_clip")(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                                           loss_mask=loss_mask, turn_ids=turn_ids, config=config)

    keywords = dict(logprobs=data["logprobs"], old_logprobs=data["old"], advantages=data["advantages"],
                    loss_mask=data["mask"], turn_ids=data["turns"], config=config)
    folded, _, _ = call_policy_loss(old_style, token_weights=weights, **keywords)
    taken, _, _ = call_policy_loss(get_policy_loss("ppo_clip"), token_weights=weights, **keywords)
    torch.testing.assert_close(folded, taken, rtol=1e-12, atol=1e-15)
    assert torch.equal(seen["mask"], data["mask"] & (weights > 0))


def actor_gradient(trainer, batch) -> torch.Tensor:
    trainer.actor_gradients(batch)
    return torch.cat([p.grad.flatten() for p in trainer.state.actor.parameters() if p.grad is not None]).clone()


@pytest.mark.parametrize("algo", ["gmpo", "gspo", "so_grpo", "m2po"])
def test_tokens_masked_by_the_rollout_correction_are_truly_dropped_from_the_update(tiny_model, tmp_path, algo):
    """mis drops the tokens whose weight pi_old / pi_sample is above the cap: the update's gradient is that of the
    same batch scored with those tokens off its mask, for sequence-, turn- and token-level rules alike."""
    from stppo_agent.training.trainer import Trainer

    config = toy_config(tiny_model, tmp_path, algo, iterations=1,
                        algorithm={"rollout_correction": "mis", "rollout_correction_level": "token",
                                   "kl_in_reward": 0.0},
                        rollout=dict(prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens_per_turn=3),
                        optimizer=dict(mini_batch_size=16, micro_batch_size=8, max_grad_norm=1e6),
                        monitor=dict(on_collapse="none"))
    trainer = Trainer(config, report=lambda _: None)
    batch = trainer.rollout()
    trainer.score(batch)
    generator = torch.Generator().manual_seed(0)
    dropped = batch.loss_mask & (torch.rand(batch.loss_mask.shape, generator=generator) < 0.3)
    assert dropped.any() and (batch.loss_mask & ~dropped).any()
    # the sampler's log-probs equal the trainer's (weight exactly 1) but where they are 5 nats lower (weight e^5)
    batch.sample_logprobs = torch.where(dropped, batch.old_logprobs - 5.0, batch.old_logprobs)
    trainer.score(batch)
    assert batch.stats["rollout_correction/masked_frac"] == pytest.approx(float(dropped.sum() / batch.loss_mask.sum()))
    truly = dataclasses.replace(batch, loss_mask=batch.loss_mask & ~dropped,
                                turn_ids=torch.where(dropped, -1, batch.turn_ids))
    truly.sample_logprobs = truly.old_logprobs.clone()
    trainer.score(truly)
    torch.testing.assert_close(actor_gradient(trainer, batch), actor_gradient(trainer, truly), rtol=1e-5, atol=1e-7)
