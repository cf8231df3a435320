"""``stppo_agent.algorithms.stabilizers``: the 2025-26 stabilisers (CISPO, SAPO,
GMPO, DPPO, M2PO, Dr. GRPO, DAPO) and per-turn GAE against plain loops at token, turn and sequence level and by
hand at their boundaries; M2PO's statistic over 2 gloo processes; DAPO's group filter; the presets."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from stppo_agent.algorithms import (
    ALGORITHMS,
    AlgorithmConfig,
    dropped_group_count,
    estimate_advantages,
    get_advantage_estimator,
    get_policy_loss,
    informative_groups,
    register_advantage_estimator,
)
from stppo_agent.algorithms.advantages import ADVANTAGE_ESTIMATORS
from stppo_agent.algorithms.losses import aggregate
from stppo_agent.algorithms.second_moment import m2po_keep_mask
from stppo_agent.distributed.process_group import free_port
from tests.support import algorithm_reference as ref
from tests.support.batches import EXERCISE, F64, LEVELS, _policy_grads, _ratio_batch, probability_batch, t64
from tests.support.batches import random_batch as random_batch
from tests.support.gloo_ranks import gloo_rank, start_ranks

SEEDS = range(6)
RULES = {
    "cispo": lambda c, lp, d: ref.ref_cispo(lp, d["old"], d["advantages"], d["mask"], d["turns"], c.ratio_level,
                                            c.clip_low, c.clip_high, c.loss_agg),
    "sapo": lambda c, lp, d: ref.ref_sapo(lp, d["old"], d["advantages"], d["mask"], d["turns"], c.ratio_level,
                                          c.tau_pos, c.tau_neg, c.loss_agg),
    "gmpo": lambda c, lp, d: ref.ref_gmpo(lp, d["old"], d["advantages"], d["mask"], d["turns"], c.ratio_level,
                                          c.clip_low, c.clip_high, c.loss_agg),
    "dppo_tv": lambda c, lp, d: ref.ref_dppo("tv", lp, d["old"], d["advantages"], d["mask"], d["turns"],
                                             c.ratio_level, c.clip_low, c.clip_high, c.is_cap, c.loss_agg),
    "dppo_kl": lambda c, lp, d: ref.ref_dppo("kl", lp, d["old"], d["advantages"], d["mask"], d["turns"],
                                             c.ratio_level, c.clip_low, c.clip_high, c.is_cap, c.loss_agg),
    "m2po": lambda c, lp, d: ref.ref_m2po(lp, d["old"], d["advantages"], d["mask"], d["turns"], c.ratio_level,
                                          c.m2_threshold, c.loss_agg),
}


def _run(config, data, logprobs=None):
    theta = (data["logprobs"] if logprobs is None else logprobs).clone().requires_grad_(True)
    loss, bias, metrics = get_policy_loss(config.policy_loss)(
        logprobs=theta, old_logprobs=data["old"], advantages=data["advantages"], loss_mask=data["mask"],
        turn_ids=data["turns"], config=config)
    return theta, loss, bias, metrics


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("seed", SEEDS)
def test_rule_loss_and_gradient_match_a_plain_loop(seed, rule, level):
    data = probability_batch(seed, torch.float64, spread=0.4)
    config = dataclasses.replace(ALGORITHMS[rule], ratio_level=level, **EXERCISE.get(rule, {}))
    theta, loss, _, metrics = _run(config, data)
    loss.backward()
    reference_theta = data["logprobs"].clone().requires_grad_(True)
    expected = RULES[rule](config, reference_theta, data)
    if not torch.is_tensor(expected) or not expected.requires_grad:  # no policy tokens: nothing to compare
        assert loss.item() == pytest.approx(float(expected)) and not theta.grad.any()
        return
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(theta.grad, reference_theta.grad, rtol=1e-9, atol=1e-12)
    assert all(not value.requires_grad for value in metrics.values())


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_changes_something_on_the_reference_batches(rule):
    """The reference comparison above means something: over its batches the rule clips, masks or gates tokens."""
    changed = 0.0
    for seed in SEEDS:
        config = dataclasses.replace(ALGORITHMS[rule], **EXERCISE.get(rule, {}))
        changed += float(_run(config, probability_batch(seed, torch.float64, spread=0.4))[3]["clip_frac"])
    assert changed > 0


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("seed", SEEDS)
def test_bias_surrogate_is_what_the_rule_took_from_importance_sampling(seed, rule):
    """At token level grad(bias) = grad agg(rho A) - grad(-pg_loss): C of docs/algorithms.md for every rule."""
    data = probability_batch(seed, torch.float64, spread=0.4)
    if not data["mask"].any():
        return
    config = dataclasses.replace(ALGORITHMS[rule], ratio_level="token", **EXERCISE.get(rule, {}))
    theta, _, bias, metrics = _run(config, data)
    if not bias.requires_grad:
        assert float(metrics["clip_frac"]) == 0.0
        return
    (bias_grad,) = torch.autograd.grad(bias, theta, retain_graph=True)
    (rule_grad,) = torch.autograd.grad(metrics_loss(config, theta, data), theta)
    ratio = torch.exp(theta - data["old"])
    is_objective = aggregate(ratio * data["advantages"], data["mask"], config.loss_agg,
                             scale=config.loss_scale_factor)
    (is_grad,) = torch.autograd.grad(is_objective, theta)
    torch.testing.assert_close(bias_grad, is_grad + rule_grad, rtol=1e-9, atol=1e-12)


def metrics_loss(config, theta, data):
    """The rule's pg_loss (no KL / entropy terms in these presets) as a function of theta."""
    return get_policy_loss(config.policy_loss)(
        logprobs=theta, old_logprobs=data["old"], advantages=data["advantages"], loss_mask=data["mask"],
        turn_ids=data["turns"], config=config)[0]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_on_policy_every_rule_is_the_policy_gradient(rule):
    """ratio 1: nothing is clipped, masked or gated, and the gradient is agg(A grad log pi) (SAPO's f'(1) = 1)."""
    data = probability_batch(4, torch.float64)
    data["old"] = data["logprobs"].clone()
    # one advantage per trajectory (GRPO's): a segment-level rule spreads a segment's advantages over its tokens
    per_trajectory = torch.randn(data["mask"].shape[0], 1, dtype=torch.float64).expand_as(data["logprobs"])
    data["advantages"] = torch.where(data["mask"], per_trajectory, 0.0)
    config = ALGORITHMS[rule]
    theta, loss, bias, metrics = _run(config, data)
    loss.backward()
    expected_theta = data["logprobs"].clone().requires_grad_(True)
    aggregate(data["advantages"] * expected_theta, data["mask"], config.loss_agg).neg().backward()
    torch.testing.assert_close(theta.grad, expected_theta.grad, rtol=1e-12, atol=1e-14)
    assert not bias.requires_grad and float(metrics["clip_frac"]) == 0.0


@pytest.mark.parametrize("rule", ["cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "dr_grpo", "dapo"])
@pytest.mark.parametrize("seed", range(4))
def test_micro_batches_add_up_to_the_full_batch_gradient(seed, rule):
    data = probability_batch(seed + 100, torch.float64, spread=0.6)
    config = dataclasses.replace(ALGORITHMS[rule], **EXERCISE.get(rule, {}))
    full, _ = _policy_grads(config, data)
    rows = list(range(data["mask"].shape[0]))
    micro = [m for m in (rows[0::2], rows[1::2]) if m]
    split, _ = _policy_grads(config, data, micro_batches=micro)
    torch.testing.assert_close(split, full)


# --- Dr. GRPO's constant normaliser, DAPO's loss --------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("seed", SEEDS)
def test_dr_grpo_and_dapo_losses_match_a_plain_loop(seed, level):
    data = probability_batch(seed, torch.float64, spread=0.4)
    for name in ("dr_grpo", "dapo"):
        config = dataclasses.replace(ALGORITHMS[name], ratio_level=level)
        theta, loss, _, _ = _run(config, data)
        expected_loss, _, _ = ref.ref_ppo_clip(data["logprobs"], data["old"], data["advantages"], data["mask"],
                                               data["turns"], level, config.clip_low, config.clip_high, "token-mean")
        if name == "dapo":
            assert loss.item() == pytest.approx(expected_loss, rel=1e-9, abs=1e-12)
            continue
        per_token = {}
        log_ratio = ref.ref_log_ratio(data["logprobs"], data["old"], data["mask"], data["turns"], level)
        for b, t in zip(*torch.nonzero(data["mask"], as_tuple=True)):
            rho, a = float(torch.exp(log_ratio[b, t])), float(data["advantages"][b, t])
            per_token[int(b), int(t)] = -min(rho * a, min(max(rho, 0.8), 1.2) * a)
        expected = ref.ref_aggregate_scaled(per_token, "seq-mean-token-sum-norm", config.loss_scale_factor)
        assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_dr_grpo_does_not_divide_by_the_group_std_nor_by_the_length():
    mask = torch.tensor([[True, False, False, False], [True, True, True, True]])
    turns = torch.where(mask, 0, -1)
    rewards, groups = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0, 0])
    config = ALGORITHMS["dr_grpo"]
    advantages, _ = get_advantage_estimator(config.advantage)(rewards=rewards, values=None, loss_mask=mask,
                                                              group_ids=groups, config=config)
    assert advantages[0, 0].item() == 0.5 and advantages[1, 0].item() == -0.5  # R - mean, no std
    logprobs = torch.full((2, 4), -1.0, dtype=torch.float64, requires_grad=True)
    loss, _, _ = get_policy_loss(config.policy_loss)(logprobs=logprobs, old_logprobs=logprobs.detach(),
                                                     advantages=advantages, loss_mask=mask, turn_ids=turns,
                                                     config=config)
    loss.backward()
    # every token's gradient is -A / (2 trajectories * 1024): the 4-token trajectory is not divided by 4
    assert logprobs.grad[1, 0].item() == pytest.approx(0.5 / (2 * 1024))
    assert logprobs.grad[0, 0].item() == pytest.approx(-0.5 / (2 * 1024))


# --- M2PO's statistic: the whole batch of every rank ------------------------------------------------------------

def _m2po_batch():
    """Rank 0's rows (0, 1) drift far, rank 1's (2, 3) barely: a per-rank statistic would mask differently."""
    gen = torch.Generator().manual_seed(7)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    turns = torch.where(mask, torch.tensor([0, 0, 1, 1, 2, 2]).expand(4, 6), -1)
    old = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 2
    drift = torch.tensor([0.6, 0.5, 0.08, 0.05], dtype=torch.float64).unsqueeze(1)
    logprobs = old + drift * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    advantages = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    return dict(logprobs=logprobs, old=old, advantages=advantages, mask=mask, turns=turns)


# per level, a threshold where the whole batch's cut differs from the drifting rank's own
M2_THRESHOLDS = {"token": 0.08, "turn": 0.08, "sequence": 0.03}


def _m2po_two_process_main(rank: int, port: int, out: str) -> None:
    with gloo_rank(rank, port):
        data, rows = _m2po_batch(), [2 * rank, 2 * rank + 1]
        results = {}
        for level in LEVELS:
            config = dataclasses.replace(ALGORITHMS["m2po"], ratio_level=level, m2_threshold=M2_THRESHOLDS[level])
            theta = data["logprobs"][rows].clone().requires_grad_(True)
            loss, _, metrics = get_policy_loss("m2po")(
                logprobs=theta, old_logprobs=data["old"][rows], advantages=data["advantages"][rows],
                loss_mask=data["mask"][rows], turn_ids=data["turns"][rows], config=config,
                global_num_tokens=data["mask"].sum().double())
            loss.backward()
            results[level] = dict(grad=theta.grad, clip_frac=metrics.parts["clip_frac"].sums,
                                  second_moment=metrics["m2po/second_moment"])
        torch.save(results, f"{out}/rank{rank}.pt")


def test_m2po_masks_by_the_second_moment_of_every_ranks_tokens(tmp_path):
    start_ranks(_m2po_two_process_main, args=(free_port(), str(tmp_path)), nprocs=2)
    shares = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    data = _m2po_batch()
    for level in LEVELS:
        threshold = M2_THRESHOLDS[level]
        config = dataclasses.replace(ALGORITHMS["m2po"], ratio_level=level, m2_threshold=threshold)
        theta, loss, _, metrics = _run(config, data)
        loss.backward()
        torch.testing.assert_close(torch.cat([shares[0][level]["grad"], shares[1][level]["grad"]]), theta.grad)
        masked = shares[0][level]["clip_frac"] + shares[1][level]["clip_frac"]
        assert masked[0].item() == pytest.approx(float(metrics.parts["clip_frac"].sums[0]))
        assert shares[1][level]["second_moment"].item() == pytest.approx(float(metrics["m2po/second_moment"]))
        # the cut of the whole batch is the plain loop's, and one a rank alone would not make: the drifting rank
        # alone keeps fewer of its tokens (the quiet rank's tokens lower the global second moment)
        keep = ref.ref_m2po_keep(data["logprobs"], data["old"], data["mask"], data["turns"], level, threshold)
        assert masked[0].item() == sum(not kept for kept in keep.values()) < len(keep)
        assert masked[0].item() > 0 or level == "sequence"  # there the whole batch is under it, rank 0 is not
        log_ratio = ref.ref_log_ratio(data["logprobs"], data["old"], data["mask"], data["turns"], level)
        alone, _ = m2po_keep_mask(log_ratio[:2], data["mask"][:2], data["turns"][:2], level, threshold)
        assert alone.sum() < sum(kept for (b, _), kept in keep.items() if b < 2)


def test_m2po_keeps_one_segment_when_no_cut_reaches_the_threshold():
    mask = torch.ones(1, 3, dtype=torch.bool)
    log_ratio = torch.tensor([[1.0, -2.0, 3.0]], dtype=torch.float64)
    keep, second_moment = m2po_keep_mask(log_ratio, mask, torch.zeros(1, 3, dtype=torch.long), "token", 0.5)
    assert keep.tolist() == [[True, False, False]] and second_moment.item() == pytest.approx(14 / 3)


# --- per-turn GAE -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_turn_gae_matches_a_per_turn_loop(seed):
    data = probability_batch(seed, torch.float64)
    gamma, lam = data["rng"].choice([1.0, 0.99, 0.9]), data["rng"].choice([1.0, 0.95, 0.5, 0.0])
    kl_penalty = 0.01 * torch.randn(data["mask"].shape, dtype=torch.float64) if seed % 2 else None
    config = AlgorithmConfig(advantage="turn_gae", gamma=gamma, lam=lam, whiten_advantages=False)
    noise = 100 * torch.randn_like(data["values"])  # observation positions must not matter
    advantages, returns = estimate_advantages(
        "turn_gae", rewards=data["rewards"], values=torch.where(data["mask"], data["values"], noise),
        loss_mask=data["mask"], group_ids=data["groups"], config=config, kl_penalty=kl_penalty,
        turn_ids=data["turns"])
    expected_adv, expected_ret = ref.ref_turn_gae(data["rewards"], data["values"], data["mask"], data["turns"],
                                                  gamma, lam, kl_penalty)
    torch.testing.assert_close(advantages, expected_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, expected_ret, rtol=1e-12, atol=1e-12)
    whitened, _ = estimate_advantages(
        "turn_gae", rewards=data["rewards"], values=data["values"], loss_mask=data["mask"],
        group_ids=data["groups"], config=dataclasses.replace(config, whiten_advantages=True), kl_penalty=kl_penalty,
        turn_ids=data["turns"])
    if data["mask"].sum() > 1:
        torch.testing.assert_close(whitened, ref.ref_whiten(expected_adv, data["mask"]), rtol=1e-9, atol=1e-12)


def test_turn_gae_reads_the_value_at_each_turns_first_token_and_discounts_per_turn():
    # one trajectory, turns 0 and 2 (turn 1 empty), 2 tokens each, observation tokens between
    mask = torch.tensor([[True, True, False, True, True]])
    turns = torch.tensor([[0, 0, -1, 2, 2]])
    values = torch.tensor([[0.5, 9.0, 7.0, 0.25, 9.0]], dtype=torch.float64)
    config = AlgorithmConfig(gamma=0.5, lam=1.0, whiten_advantages=False)
    advantages, returns = estimate_advantages("turn_gae", rewards=torch.tensor([1.0], dtype=torch.float64),
                                              values=values, loss_mask=mask, group_ids=torch.tensor([0]),
                                              config=config, turn_ids=turns)
    last = 1.0 - 0.25  # r - V(turn 2)
    first = 0.0 + 0.5 * 0.25 - 0.5 + 0.5 * last  # delta_0 + gamma * lambda * A_1, one discount per turn
    assert advantages.tolist() == [[first, first, 0.0, last, last]]
    assert returns.tolist() == [[first + 0.5, first + 0.5, 0.0, 1.0, 1.0]]


def test_estimate_advantages_passes_turn_ids_only_to_estimators_that_take_them():
    seen = {}

    def old_style(*, rewards, values, loss_mask, group_ids, config, kl_penalty=None):
        seen["old"] = True
        return get_advantage_estimator("grpo")(rewards=rewards, values=values, loss_mask=loss_mask,
                                               group_ids=group_ids, config=config)

    ADVANTAGE_ESTIMATORS._items.pop("test_old_style", None)
    register_advantage_estimator("test_old_style", old_style)
    data = probability_batch(1, torch.float64)
    kwargs = dict(rewards=data["rewards"], values=data["values"], loss_mask=data["mask"], group_ids=data["groups"],
                  config=AlgorithmConfig())
    estimate_advantages("test_old_style", turn_ids=data["turns"], **kwargs)
    assert seen == {"old": True}
    for name in ("gae", "grpo", "rloo"):  # the built-in ones take turn_ids and ignore them
        estimate_advantages(name, turn_ids=data["turns"], **kwargs)
    with pytest.raises(ValueError, match="turn_gae needs turn_ids"):
        get_advantage_estimator("turn_gae")(**kwargs)


# --- DAPO's dynamic sampling filter -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_informative_groups_keeps_the_groups_with_a_reward_spread(seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (12,), generator=gen).float()
    groups = torch.randint(0, 5, (12,), generator=gen)
    keep = informative_groups(rewards, groups)
    assert torch.equal(keep, ref.ref_informative_groups(rewards, groups))
    assert dropped_group_count(keep, groups) == len({int(g) for g, k in zip(groups, keep) if not k})


def test_informative_groups_drops_all_equal_and_single_member_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.2])
    groups = torch.tensor([0, 0, 1, 1, 2, 3])
    keep = informative_groups(rewards, groups)
    assert keep.tolist() == [False, False, True, True, False, False]
    assert dropped_group_count(keep, groups) == 3


# --- presets -----------------------------------------------------------------------------------------------------

def test_presets_carry_the_papers_and_verls_defaults():
    table = {  # name: (policy loss, advantage, ratio level, loss_agg, clip_low, clip_high)
        "cispo": ("cispo", "grpo", "token", "token-mean", 1.0, 0.2),
        "sapo": ("sapo", "grpo", "token", "seq-mean-token-mean", 0.2, 0.2),
        "gmpo": ("gmpo", "grpo", "sequence", "seq-mean-token-mean", 0.4, 0.4),
        "dppo_tv": ("dppo_tv", "grpo", "token", "token-mean", 0.15, 0.15),
        "dppo_kl": ("dppo_kl", "grpo", "token", "token-mean", 0.05, 0.05),
        "m2po": ("m2po", "grpo", "token", "token-mean", 0.2, 0.2),
        "dr_grpo": ("ppo_clip", "grpo", "token", "seq-mean-token-sum-norm", 0.2, 0.2),
        "dapo": ("ppo_clip", "grpo", "token", "token-mean", 0.2, 0.28),
        "turn_gae": ("ppo_clip", "turn_gae", "turn", "token-mean", 0.2, 0.2),
    }
    for name, row in table.items():
        preset = ALGORITHMS[name]
        assert (preset.policy_loss, preset.advantage, preset.ratio_level, preset.loss_agg, preset.clip_low,
                preset.clip_high) == row, name
        assert preset.use_critic == (name == "turn_gae") and preset.clip_bias_correction is False
    assert (ALGORITHMS["sapo"].tau_pos, ALGORITHMS["sapo"].tau_neg) == (1.0, 1.05)
    assert ALGORITHMS["dppo_tv"].is_cap == ALGORITHMS["dppo_kl"].is_cap == 1e4  # the authors' script: no truncation
    assert ALGORITHMS["m2po"].m2_threshold == 0.04
    assert ALGORITHMS["dr_grpo"].grpo_std_normalize is False and ALGORITHMS["dr_grpo"].loss_scale_factor == 1024.0
    assert ALGORITHMS["dapo"].dynamic_sampling and not ALGORITHMS["grpo"].dynamic_sampling
    assert all(ALGORITHMS[name].kl_loss_coef == 0.0 for name in table if name != "turn_gae")


def test_new_fields_refuse_bad_values():
    for field in ("tau_pos", "tau_neg", "is_cap", "m2_threshold", "loss_scale_factor"):
        with pytest.raises(ValueError, match=f"{field} must be > 0"):
            AlgorithmConfig(**{field: 0.0})
    with pytest.raises(ValueError, match="max_resample_rounds"):
        AlgorithmConfig(max_resample_rounds=-1)
    with pytest.raises(ValueError, match="clip_low <= 1"):
        AlgorithmConfig(clip_low=1.01)
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        AlgorithmConfig(loss_agg="seq-sum")


def test_cispo_in_its_paper_form_has_no_lower_bound(tiny_model, tmp_path):
    """The preset's clip_low is 1: a token whose ratio fell to e^-6.9 keeps that weight (a lower bound of 0.2 or 0.01
    would have raised it), and a run with the step diagnostics (whose band once refused clip_low = 1) trains."""
    from stppo_agent.runs.metrics_log import read_metrics
    from stppo_agent.training.trainer import Trainer
    from tests.support.runs import toy_config

    assert ALGORITHMS["cispo"].clip_low == 1.0
    logprobs = torch.tensor([[-6.9, 0.1]], dtype=torch.float64, requires_grad=True)
    loss, _, metrics = get_policy_loss("cispo")(
        logprobs=logprobs, old_logprobs=torch.zeros(1, 2, dtype=torch.float64),
        advantages=-torch.ones(1, 2, dtype=torch.float64), loss_mask=torch.ones(1, 2, dtype=torch.bool),
        turn_ids=torch.zeros(1, 2, dtype=torch.long), config=ALGORITHMS["cispo"])
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert float(grad[0, 0]) == pytest.approx(math.exp(-6.9) / 2, rel=1e-12)  # -w A / 2 tokens, w = rho
    assert float(metrics["clip_frac"]) == 0.0  # nothing below a lower bound that is not there
    Trainer(toy_config(tiny_model, tmp_path, "cispo", iterations=2, logging=dict(step_diagnostics=True),
                       monitor=dict(on_collapse="none"))).train()
    steps = read_metrics(tmp_path, "steps.jsonl")
    assert steps and all(math.isfinite(step["grad_norm"]) for step in steps)


# --- the toy env, learnt by every new preset ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


NEW_PRESETS = ["cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "m2po", "dr_grpo", "dapo", "turn_gae"]


@pytest.mark.parametrize("algo", NEW_PRESETS)
def test_every_new_preset_learns_the_toy_env(tiny_model, tmp_path, algo):
    from stppo_agent.runs.metrics_log import read_metrics
    from stppo_agent.training.trainer import Trainer
    from tests.support.runs import toy_config

    Trainer(toy_config(tiny_model, tmp_path, algo)).train()
    curve = [record["reward"] for record in read_metrics(tmp_path)]
    assert curve[0] < 0.4, curve  # chance: 1/9 per turn for the untrained model
    assert sum(curve[-3:]) / 3 > 0.8, curve
    assert {"clip_frac", "turn_clip_frac", "ratio/mean", "approx_kl"} <= set(read_metrics(tmp_path)[-1])


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
