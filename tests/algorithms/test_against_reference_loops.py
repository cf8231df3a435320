"""Algorithms against reference loops (random shapes, layouts, gammas, lambdas, dtypes) and their properties."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from stppo_agent.algorithms import (
    ADVANTAGE_ESTIMATORS,
    ALGORITHMS,
    POLICY_LOSSES,
    AlgorithmConfig,
    get_advantage_estimator,
    get_policy_loss,
    kl_estimate,
    log_ratio_at_level,
    register_advantage_estimator,
    register_policy_loss,
    value_loss,
)
from stppo_agent.algorithms.segments import discounted_reverse_cumsum
from tests.support import algorithm_reference as ref
from tests.support.batches import LEVELS, _policy_grads, random_batch, tolerance

# Under mutation testing (`make mutants` sets MUTANT_UNDER_TEST) 3 random layouts per case instead of 12: each
# mutant reruns these tests (a speed trade-off: CI runs all 12).
SEEDS = range(3) if os.environ.get("MUTANT_UNDER_TEST") else range(12)
DTYPES = (torch.float32, torch.float64)


# --- reference agreement ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_gae_matches_reference(seed, dtype):
    data = random_batch(seed, dtype)
    gamma, lam = data["rng"].choice([1.0, 0.99, 0.9]), data["rng"].choice([1.0, 0.95, 0.5, 0.0])
    kl_penalty = 0.01 * torch.randn(data["mask"].shape, dtype=dtype) if seed % 2 else None
    config = AlgorithmConfig(gamma=gamma, lam=lam, whiten_advantages=False)
    advantages, returns = get_advantage_estimator("gae")(
        rewards=data["rewards"], values=data["values"], loss_mask=data["mask"], group_ids=data["groups"],
        config=config, kl_penalty=kl_penalty)
    expected_adv, expected_ret = ref.ref_gae(data["rewards"], data["values"], data["mask"], gamma, lam, kl_penalty)
    torch.testing.assert_close(advantages, expected_adv, **tolerance(dtype))
    torch.testing.assert_close(returns, expected_ret, **tolerance(dtype))
    whitened, _ = get_advantage_estimator("gae")(
        rewards=data["rewards"], values=data["values"], loss_mask=data["mask"], group_ids=data["groups"],
        config=dataclasses.replace(config, whiten_advantages=True), kl_penalty=kl_penalty)
    if data["mask"].sum() > 1:
        torch.testing.assert_close(whitened, ref.ref_whiten(expected_adv, data["mask"]), **tolerance(dtype))


@pytest.mark.parametrize("discount", [0.0, 0.3, 0.9, 0.999, 1.0])
def test_discounted_reverse_cumsum_matches_loop(discount):
    x = torch.randn(3, 37, dtype=torch.float64)
    expected = torch.zeros_like(x)
    running = torch.zeros(3, dtype=torch.float64)
    for t in reversed(range(37)):
        running = x[:, t] + discount * running
        expected[:, t] = running
    torch.testing.assert_close(discounted_reverse_cumsum(x, discount), expected)


@pytest.mark.parametrize("mode", ["grpo", "rloo"])
@pytest.mark.parametrize("seed", SEEDS)
def test_group_estimators_match_reference(seed, mode):
    data = random_batch(seed, torch.float64)
    data["rewards"] = torch.rand(len(data["rewards"]), dtype=torch.float64)
    for std_normalize in (True, False):
        config = AlgorithmConfig(advantage=mode, grpo_std_normalize=std_normalize)
        advantages, returns = get_advantage_estimator(mode)(
            rewards=data["rewards"], values=None, loss_mask=data["mask"], group_ids=data["groups"], config=config)
        expected = ref.ref_group_advantages(data["rewards"], data["groups"], data["mask"], mode, std_normalize)
        torch.testing.assert_close(advantages, expected)
        assert torch.equal(advantages, returns)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("seed", SEEDS)
def test_log_ratio_levels_match_reference(seed, level, dtype):
    data = random_batch(seed, dtype)
    got = log_ratio_at_level(data["logprobs"], data["old"], data["mask"], data["turns"], level)
    expected = ref.ref_log_ratio(data["logprobs"], data["old"], data["mask"], data["turns"], level)
    torch.testing.assert_close(got, expected, **tolerance(dtype))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_clip_loss_matches_reference(seed, level, dtype, agg):
    data = random_batch(seed, dtype, spread=0.4)
    config = AlgorithmConfig(ratio_level=level, clip_low=0.2, clip_high=0.28, loss_agg=agg)
    loss, bias, metrics = get_policy_loss("ppo_clip")(
        logprobs=data["logprobs"], old_logprobs=data["old"], advantages=data["advantages"],
        loss_mask=data["mask"], turn_ids=data["turns"], config=config)
    expected_loss, expected_bias, expected_clip = ref.ref_ppo_clip(
        data["logprobs"], data["old"], data["advantages"], data["mask"], data["turns"], level, 0.2, 0.28, agg)
    tol = tolerance(dtype)
    torch.testing.assert_close(loss, torch.tensor(expected_loss, dtype=dtype), **tol)
    torch.testing.assert_close(bias, torch.tensor(expected_bias, dtype=dtype), **tol)
    torch.testing.assert_close(metrics["clip_frac"], torch.tensor(expected_clip, dtype=dtype), **tol)
    assert all(not value.requires_grad for value in metrics.values())


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss_matches_reference(seed):
    data = random_batch(seed, torch.float64)
    old_values = data["values"] + 0.8 * torch.randn_like(data["values"])
    returns = torch.randn_like(data["values"])
    config = AlgorithmConfig(value_clip=0.5)
    loss, metrics = value_loss(values=data["values"], old_values=old_values, returns=returns,
                               loss_mask=data["mask"], config=config)
    expected = ref.ref_value_loss(data["values"], old_values, returns, data["mask"], 0.5)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    assert {"value_loss", "explained_variance", "value_clip_frac"} <= set(metrics)


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref_logp = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    log_ratio = logp - ref_logp
    torch.testing.assert_close(kl_estimate(logp, ref_logp, "k1"), log_ratio)
    torch.testing.assert_close(kl_estimate(logp, ref_logp, "k2"), 0.5 * log_ratio**2)
    torch.testing.assert_close(kl_estimate(logp, ref_logp, "k3"), torch.exp(-log_ratio) - 1 + log_ratio)
    big = kl_estimate(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl")
    assert big.item() == 10.0


# --- properties ---------------------------------------------------------------------------------------------

def _grad(level, data, advantages, config_kwargs=None):
    logprobs = data["old"].clone().requires_grad_(True)  # on-policy: ratio exactly 1
    config = AlgorithmConfig(ratio_level=level, **(config_kwargs or {}))
    loss, _, _ = get_policy_loss("ppo_clip")(logprobs=logprobs, old_logprobs=data["old"], advantages=advantages,
                                             loss_mask=data["mask"], turn_ids=data["turns"], config=config)
    loss.backward()
    return logprobs.grad


@pytest.mark.parametrize("seed", SEEDS)
def test_on_policy_all_ratio_levels_give_the_same_gradient(seed):
    data = random_batch(seed, torch.float64)
    per_trajectory = torch.randn(data["mask"].shape[0], 1, dtype=torch.float64).expand_as(data["values"])
    advantages = torch.where(data["mask"], per_trajectory, torch.zeros(()).double())
    token, turn, sequence = (_grad(level, data, advantages) for level in LEVELS)
    torch.testing.assert_close(turn, token)
    torch.testing.assert_close(sequence, token)


@pytest.mark.parametrize("seed", SEEDS)
def test_nothing_clipped_s_ppo_is_ppo_and_st_ppo_is_turn_ppo(seed):
    data = random_batch(seed, torch.float64, spread=0.01)  # ratios stay well inside [0.8, 1.2]
    for plain, corrected in (("ppo", "s_ppo"), ("turn_ppo", "st_ppo")):
        base, _ = _policy_grads(ALGORITHMS[plain], data)
        grad, metrics = _policy_grads(ALGORITHMS[corrected], data)
        assert torch.equal(base, grad)
        assert metrics["clip_bias_norm"].item() == 0.0 and metrics["clip_bias_scale"].item() == 1.0


@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
def test_bias_surrogate_needs_a_backward_only_when_something_is_clipped(level):
    """Nothing clipped -> C's share is exactly 0 and the surrogate is detached (the corrector skips a backward)."""
    loss_fn = get_policy_loss("ppo_clip")
    config = dataclasses.replace(ALGORITHMS["st_ppo"], ratio_level=level)
    for spread, clipped in ((0.0, False), (1.5, True)):
        data = random_batch(3, torch.float64, spread=spread)
        logprobs = data["logprobs"].clone().requires_grad_(True)
        _, bias, metrics = loss_fn(logprobs=logprobs, old_logprobs=data["old"], advantages=data["advantages"],
                                   loss_mask=data["mask"], turn_ids=data["turns"], config=config)
        assert bias.requires_grad == clipped == bool(metrics["clip_frac"] > 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_bias_correction_scales_by_the_bias_norm(seed):
    data = random_batch(seed, torch.float64, spread=1.5)  # plenty clipped
    config = dataclasses.replace(ALGORITHMS["s_ppo"], clip_bias_kappa=0.01)
    base, _ = _policy_grads(config, data, with_correction=False)
    grad, metrics = _policy_grads(config, data)
    # reference C at token level: d/dl_t of c_t rho_t A_t / N = c_t rho_t A_t / N
    mask, adv = data["mask"], data["advantages"]
    rho = torch.exp(data["logprobs"] - data["old"])
    clipped = mask & (((adv > 0) & (rho > 1.2)) | ((adv < 0) & (rho < 0.8)))
    bias_grad = torch.where(clipped, rho * adv, torch.zeros(()).double()) / mask.sum().clamp(min=1)
    expected_scale = max(1.0, bias_grad.norm().item() / 0.01)
    assert metrics["clip_bias_norm"].item() == pytest.approx(bias_grad.norm().item(), rel=1e-9, abs=1e-12)
    assert metrics["clip_bias_scale"].item() == pytest.approx(expected_scale, rel=1e-9)
    assert metrics["pg_grad_norm"].item() == pytest.approx(base.norm().item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, base / expected_scale)


@pytest.mark.parametrize("preset", ["ppo", "st_ppo", "grpo", "gspo", "so_grpo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("seed", range(6))
def test_micro_batching_gives_the_full_batch_gradient(seed, preset, agg):
    data = random_batch(seed + 100, torch.float64, spread=0.8)
    config = dataclasses.replace(ALGORITHMS[preset], loss_agg=agg, clip_bias_kappa=0.05)
    full, full_metrics = _policy_grads(config, data)
    rows = list(range(data["mask"].shape[0]))
    micro = [rows[i::2] for i in range(2)] if len(rows) > 1 else [rows]
    micro = [m for m in micro if m]
    split, split_metrics = _policy_grads(config, data, micro_batches=micro)
    torch.testing.assert_close(split, full)
    for key in full_metrics:
        torch.testing.assert_close(split_metrics[key], full_metrics[key])


@pytest.mark.parametrize("seed", SEEDS)
def test_observation_positions_change_nothing(seed):
    data = random_batch(seed, torch.float64, spread=0.6)
    mask = data["mask"]
    noise = 100 * torch.randn_like(data["values"])
    noisy_values = torch.where(mask, data["values"], noise)
    for config in (AlgorithmConfig(), AlgorithmConfig(gamma=0.9, lam=0.8)):
        clean = get_advantage_estimator("gae")(rewards=data["rewards"], values=data["values"], loss_mask=mask,
                                               group_ids=data["groups"], config=config)
        noisy = get_advantage_estimator("gae")(rewards=data["rewards"], values=noisy_values, loss_mask=mask,
                                               group_ids=data["groups"], config=config)
        assert torch.equal(clean[0], noisy[0]) and torch.equal(clean[1], noisy[1])
    for level in LEVELS:
        config = AlgorithmConfig(ratio_level=level)
        outputs = []
        for logprobs, old in ((data["logprobs"], data["old"]),
                              (torch.where(mask, data["logprobs"], noise), torch.where(mask, data["old"], -noise))):
            theta = logprobs.clone().requires_grad_(True)
            loss, bias, metrics = get_policy_loss("ppo_clip")(
                logprobs=theta, old_logprobs=old, advantages=torch.where(mask, data["advantages"], noise),
                loss_mask=mask, turn_ids=data["turns"], config=config)
            loss.backward()
            outputs.append((loss, bias, metrics, theta.grad))
        (l1, b1, m1, g1), (l2, b2, m2, g2) = outputs
        assert torch.equal(l1, l2) and torch.equal(b1, b2)
        assert all(torch.equal(m1[k], m2[k]) for k in m1)
        assert torch.equal(g1, g2) and not g1[~mask].any()


@pytest.mark.parametrize("seed", SEEDS)
def test_turn_ratios_do_not_depend_on_turn_order(seed):
    data = random_batch(seed, torch.float64)
    permutation = torch.stack([torch.randperm(data["mask"].shape[1], generator=torch.Generator().manual_seed(seed + b))
                               for b in range(data["mask"].shape[0])])
    def shuffled(x):
        return x.gather(1, permutation)
    original = log_ratio_at_level(data["logprobs"], data["old"], data["mask"], data["turns"], "turn")
    permuted = log_ratio_at_level(shuffled(data["logprobs"]), shuffled(data["old"]), shuffled(data["mask"]),
                                  shuffled(data["turns"]), "turn")
    torch.testing.assert_close(permuted, shuffled(original), rtol=1e-12, atol=1e-12)


# --- registries and presets ---------------------------------------------------------------------------------

def test_presets_match_the_table():
    table = {
        "ppo": ("gae", "token", False, True), "turn_ppo": ("gae", "turn", False, True),
        "s_ppo": ("gae", "token", True, True), "st_ppo": ("gae", "turn", True, True),
        "grpo": ("grpo", "token", False, False), "gspo": ("grpo", "sequence", False, False),
        "so_grpo": ("grpo", "turn", True, False),
    }
    for name, (advantage, level, correction, critic) in table.items():
        preset = ALGORITHMS[name]
        assert (preset.advantage, preset.ratio_level, preset.clip_bias_correction, preset.use_critic) == (
            advantage, level, correction, critic), name
    assert (ALGORITHMS["gspo"].clip_low, ALGORITHMS["gspo"].clip_high) == (3e-4, 4e-4)
    assert (ALGORITHMS["grpo"].kl_loss_coef, ALGORITHMS["grpo"].kl_estimator) == (0.001, "k3")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ALGORITHMS["ppo"].clip_low = 0.3


def test_user_registered_loss_and_estimator_are_selectable_by_name():
    calls = []

    def my_loss(**kwargs):
        calls.append(kwargs["config"].policy_loss)
        return get_policy_loss("ppo_clip")(**kwargs)

    for registry, name in ((POLICY_LOSSES, "test_user_loss"), (ADVANTAGE_ESTIMATORS, "test_user_adv")):
        registry._items.pop(name, None)  # a test run twice in one process (mutmut does) registers again
    register_policy_loss("test_user_loss", my_loss)
    register_advantage_estimator("test_user_adv")(lambda **kw: get_advantage_estimator("rloo")(**kw))
    config = dataclasses.replace(ALGORITHMS["grpo"], policy_loss="test_user_loss", advantage="test_user_adv")
    data = random_batch(0, torch.float32)
    advantages, _ = get_advantage_estimator(config.advantage)(
        rewards=data["rewards"], values=None, loss_mask=data["mask"], group_ids=data["groups"], config=config)
    get_policy_loss(config.policy_loss)(logprobs=data["logprobs"], old_logprobs=data["old"], advantages=advantages,
                                        loss_mask=data["mask"], turn_ids=data["turns"], config=config)
    assert calls == ["test_user_loss"]
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo_clip", my_loss)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("gae", my_loss)
    with pytest.raises(KeyError, match="known: .*ppo_clip"):
        get_policy_loss("ppo_clipp")
    with pytest.raises(KeyError, match="known: gae, grpo, rloo"):
        get_advantage_estimator("gea")
    with pytest.raises(KeyError, match="known: cispo, dapo, dppo_kl, dppo_tv, dr_grpo, gmpo, grpo, gspo, m2po, ppo, "
                                       "s_ppo, sapo, so_grpo, st_ppo, turn_gae, turn_ppo"):
        ALGORITHMS["stppo"]


def test_bad_config_values_raise():
    with pytest.raises(ValueError, match="ratio_level must be one of token, turn, sequence"):
        AlgorithmConfig(ratio_level="turns")
    with pytest.raises(ValueError, match="clip_bias_kappa"):
        AlgorithmConfig(clip_bias_kappa=0)


def test_entropy_and_kl_terms_enter_the_loss():
    data = random_batch(3, torch.float64)
    entropy = torch.rand_like(data["values"])
    base_config = AlgorithmConfig()
    kwargs = dict(logprobs=data["logprobs"], old_logprobs=data["old"], advantages=data["advantages"],
                  loss_mask=data["mask"], turn_ids=data["turns"])
    base, _, _ = get_policy_loss("ppo_clip")(config=base_config, **kwargs)
    with_terms, _, metrics = get_policy_loss("ppo_clip")(
        config=dataclasses.replace(base_config, entropy_coef=0.1, kl_loss_coef=0.5, kl_estimator="k2"),
        ref_logprobs=data["old"], entropy=entropy, **kwargs)
    expected = base + 0.5 * metrics["kl_loss"] - 0.1 * metrics["entropy"]
    torch.testing.assert_close(with_terms, expected)
    assert metrics["entropy"].item() > 0 and metrics["kl_loss"].item() > 0


# --- GSPO aggregation, KL numerics ----------------------------------------------------------------------------------


def test_gspo_averages_per_sequence_against_a_hand_computed_value():
    from stppo_agent.algorithms import ALGORITHMS, get_policy_loss

    gspo = ALGORITHMS["gspo"]
    assert gspo.loss_agg == "seq-mean-token-mean"
    # two trajectories of 1 and 3 policy tokens; sequence ratios s_i = exp(mean_i(logp - old))
    mask = torch.tensor([[True, False, False], [True, True, True]])
    turns = torch.tensor([[0, -1, -1], [0, 0, 1]])
    old = torch.tensor([[-1.0, 0.0, 0.0], [-1.0, -2.0, -0.5]], dtype=torch.float64)
    delta = torch.tensor([[2e-4, 0.0, 0.0], [1e-4, -3e-4, 5e-4]], dtype=torch.float64)
    logp = (old + delta).requires_grad_()
    adv = torch.tensor([[1.0, 0.0, 0.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    loss, _, _ = get_policy_loss(gspo.policy_loss)(logprobs=logp, old_logprobs=old, advantages=adv, loss_mask=mask,
                                                   turn_ids=turns, config=gspo)
    s1, s2 = math.exp(2e-4), math.exp((1e-4 - 3e-4 + 5e-4) / 3)
    l1 = -min(s1 * 1.0, min(max(s1, 1 - 3e-4), 1 + 4e-4) * 1.0)
    l2 = -min(s2 * -0.5, min(max(s2, 1 - 3e-4), 1 + 4e-4) * -0.5)
    assert loss.item() == pytest.approx((l1 + l2) / 2, rel=1e-12)  # token-mean would give (l1 + 3 l2) / 4
    loss.backward()
    # the unclipped sequence's gradient is A * s / |y| on each of its tokens, halved by the mean over 2 sequences
    expected = -(-0.5) * s2 / 3 / 2
    torch.testing.assert_close(logp.grad[1], torch.full((3,), expected, dtype=torch.float64))


@pytest.mark.parametrize("estimator", ["k3", "low_var_kl"])
def test_kl_loss_gradient_has_no_nan_with_extreme_log_ratios_in_float32(estimator):
    from stppo_agent.algorithms import AlgorithmConfig, get_policy_loss

    config = AlgorithmConfig(kl_loss_coef=0.1, kl_estimator=estimator)
    mask = torch.tensor([[True, True, False, False]])
    turns = torch.tensor([[0, 0, -1, -1]])
    old = torch.tensor([[-1.0, -2.0, 0.0, 0.0]])
    # masked positions: log-probs far below the reference (l = -150 and -95), as observation/padding positions get
    ref = torch.tensor([[-1.5, -90.0, 50.0, 5.0]])
    logp = torch.tensor([[-1.2, -1.0, -100.0, -90.0]], requires_grad=True)
    loss, _, metrics = get_policy_loss("ppo_clip")(logprobs=logp, old_logprobs=old, advantages=torch.ones(1, 4),
                                                   loss_mask=mask, turn_ids=turns, config=config, ref_logprobs=ref)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), logp.grad
    assert logp.grad[0, 2:].eq(0).all()  # masked positions get no gradient
    assert torch.isfinite(metrics["kl_loss"])
    # an unmasked extreme (l = 89 at position 1) is clamped to 20, not infinite
    assert kl_estimate(torch.tensor([-1.0]), torch.tensor([-90.0]), estimator).isfinite().all()
