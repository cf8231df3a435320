"""``stppo_agent.algorithms.advantages``: GAE, per-turn GAE, GRPO and RLOO by hand on
small batches -- every value, boundary and direction docs/algorithms.md fixes -- the KL penalty in the reward
before the group baseline, and advantages computed on the inputs' device."""

from __future__ import annotations

import math

import pytest
import torch

from stppo_agent.algorithms import advantages as advantages_module
from stppo_agent.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    compact_policy_positions,
    estimate_advantages,
    get_advantage_estimator,
    outcome_scores,
    register_advantage_estimator,
)
from stppo_agent.algorithms.config import ALGORITHMS, AlgorithmConfig
from stppo_agent.algorithms.losses import kl_reward_penalty
from stppo_agent.algorithms.segments import whiten
from tests.support import algorithm_reference as ref
from tests.support.batches import F64, t64


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


# GRPO and RLOO apply ``kl_in_reward``: the per-token KL penalty is subtracted from the outcome reward before the
# group baseline, as verl does (its token-level rewards, penalty included, summed per sequence).


def group_of_three(kl_per_token: list[float]):
    mask = torch.tensor([[True, True, False, True]] * 3)
    rewards = torch.tensor([1.0, 1.0, 0.0])
    penalty = torch.tensor(kl_per_token).unsqueeze(1) * mask
    return dict(rewards=rewards, values=None, loss_mask=mask, group_ids=torch.tensor([7, 7, 7])), penalty


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_a_higher_kl_trajectory_gets_a_lower_advantage(name):
    estimator, config = get_advantage_estimator(name), ALGORITHMS["grpo"]
    inputs, penalty = group_of_three([0.0, 0.1, 0.0])  # the first two earned the same reward; the second drifted
    plain, _ = estimator(**inputs, config=config)
    penalised, returns = estimator(**inputs, config=config, kl_penalty=penalty)
    assert float(plain[0, 0]) == float(plain[1, 0])
    assert float(penalised[1, 0]) < float(penalised[0, 0])
    assert not torch.equal(plain, penalised) and torch.equal(penalised, returns)
    assert (penalised[~inputs["loss_mask"]] == 0).all()
    # the penalty is summed over the policy tokens: the scores are R - 3 * 0.1 for the drifting trajectory
    scores = torch.tensor([1.0, 1.0 - 0.3, 0.0])
    if name == "grpo":
        expected = (scores - scores.mean()) / (scores.std() + 1e-6)
    else:
        expected = scores - (scores.sum() - scores) / 2
    torch.testing.assert_close(penalised[:, 0], expected)


def test_a_kl_penalty_of_zero_changes_nothing_and_a_uniform_one_cancels_in_the_baseline():
    estimator, config = get_advantage_estimator("grpo"), ALGORITHMS["grpo"]
    inputs, zero = group_of_three([0.0, 0.0, 0.0])
    plain, _ = estimator(**inputs, config=config)
    assert torch.equal(estimator(**inputs, config=config, kl_penalty=zero)[0], plain)
    _, uniform = group_of_three([0.2, 0.2, 0.2])
    torch.testing.assert_close(estimator(**inputs, config=config, kl_penalty=uniform)[0], plain)


def test_the_trainer_feeds_the_penalty_to_grpo(tmp_path):
    """``--algo grpo --set algorithm.kl_in_reward=...`` changes the advantages of a real batch."""
    import dataclasses

    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
    from stppo_agent.training.trainer import Trainer
    from tests.support.runs import toy_config

    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    trainer = Trainer(toy_config(model, tmp_path / "run", "grpo", iterations=1,
                                 algorithm={"kl_in_reward": 5.0, "kl_loss_coef": 0.0, "grpo_std_normalize": False},
                                 rollout=dict(prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens_per_turn=3,
                                              max_total_tokens=40),
                                 optimizer=dict(mini_batch_size=8, micro_batch_size=8),
                                 monitor=dict(on_collapse="none")))
    with torch.no_grad():  # a reference away from the actor, so that the KL is not 0
        for parameter in trainer.state.reference.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    torch.manual_seed(0)
    batch = trainer.rollout()
    penalised, plain = batch.select(range(batch.batch_size)), batch.select(range(batch.batch_size))
    trainer.score(penalised)
    trainer.algo = dataclasses.replace(trainer.algo, kl_in_reward=0.0)
    trainer.score(plain)
    mask = batch.loss_mask
    assert not torch.allclose(penalised.advantages[mask], plain.advantages[mask])
    # Dr. GRPO (no std division): each advantage moves by -(K_b - mean_g K), K_b its summed penalty
    kl = torch.where(mask, penalised.old_logprobs - penalised.ref_logprobs, 0.0).sum(1)
    shift = penalised.advantages.sum(1) / mask.sum(1) - plain.advantages.sum(1) / mask.sum(1)
    for group in batch.group_ids.unique():
        rows = (batch.group_ids == group).nonzero().flatten()
        most, least = rows[kl[rows].argmax()], rows[kl[rows].argmin()]
        if float(kl[most] - kl[least]) > 1e-3:
            assert float(shift[most]) < float(shift[least])


def _outcome_batch():
    """Two groups (one of three, one of two) and a trajectory alone, float64, with per-token KL penalties."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 3.0], dtype=F64)
    values = torch.linspace(-1.0, 1.0, 24, dtype=F64).reshape(6, 4)
    loss_mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1], [1, 0, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]],
                             dtype=torch.bool)
    group_ids = torch.tensor([7, 7, 7, 2, 2, 9])
    kl_penalty = torch.linspace(0.0, 0.23, 24, dtype=F64).reshape(6, 4)
    turn_ids = torch.where(loss_mask, torch.tensor([0, 0, 1, 1]).expand(6, 4), -1)
    return dict(rewards=rewards, values=values, loss_mask=loss_mask, group_ids=group_ids, kl_penalty=kl_penalty,
                turn_ids=turn_ids)


# -- advantages ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "rloo", "gae", "turn_gae"])
def test_advantages_are_computed_on_the_inputs_device_whatever_the_default_device(name):
    batch = _outcome_batch()
    config = AlgorithmConfig(gamma=0.9, lam=0.8, whiten_advantages=False)
    expected = estimate_advantages(name, config=config, **batch)
    assert expected[0].abs().sum() > 0  # a batch where the estimator has something to say
    with torch.device("meta"):
        advantages, returns = estimate_advantages(name, config=config, **batch)
    for got, want in zip((advantages, returns), expected):
        assert got.device.type == "cpu" and got.dtype == F64
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_kl_penalty_lowers_the_reward_by_the_expected_amount():
    config = ALGORITHMS["ppo"]  # kl_in_reward 0.001
    mask = torch.tensor([[True, True, False, True]])
    old = torch.tensor([[-1.0, -2.0, -9.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, 0.0, -0.5]])
    penalty = kl_reward_penalty(old, ref, mask, config)
    expected = 0.001 * torch.tensor([[0.5, -1.0, 0.0, 0.0]])
    torch.testing.assert_close(penalty, expected)
    from stppo_agent.algorithms import get_advantage_estimator

    rewards = torch.tensor([1.0])
    values = torch.zeros(1, 4)
    plain = dict(rewards=rewards, values=values, loss_mask=mask, group_ids=torch.tensor([0]),
                 config=ALGORITHMS["ppo"].__class__(whiten_advantages=False))
    _, returns = get_advantage_estimator("gae")(**plain)
    _, penalised = get_advantage_estimator("gae")(**plain, kl_penalty=penalty)
    # gamma = lam = 1: the return at the first token is R minus the sum of the penalties from there on
    assert float(returns[0, 0] - penalised[0, 0]) == pytest.approx(float(penalty.sum()), abs=1e-7)
    assert float(penalised[0, 0]) == pytest.approx(1.0 - 0.001 * (0.5 - 1.0), abs=1e-7)
