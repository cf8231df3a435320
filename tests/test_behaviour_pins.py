"""Tests that pin behaviour by value where realistic one-line bugs used to pass (issue 14)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stppo_agent.algorithms import ALGORITHMS, kl_reward_penalty
from stppo_agent.algorithms.losses import explained_variance, value_loss
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import merged
from stppo_agent.training.trainer import Trainer
from stppo_envs.actions import ActionType, parse_action
from stppo_envs.scoring import exact_match, f1_score, normalize_answer

from .conftest import KeywordRetriever
from .test_trainer import toy_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


def small(model, out, algo="ppo", **overrides):
    values = dict(iterations=1, rollout=dict(prompts_per_iteration=4, samples_per_prompt=2),
                  optimizer=dict(mini_batch_size=4, micro_batch_size=2, epochs=2, actor_lr=1e-2, critic_lr=1e-2),
                  checkpoint=dict(every=1))
    values = merged(values, overrides)
    return toy_config(model, out, algo, **values)


# --- trainer -------------------------------------------------------------------------------------------------

def test_the_critic_takes_optimizer_steps(tiny_model, tmp_path):
    trainer = Trainer(small(tiny_model, tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.state.critic.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.state.critic.named_parameters() if not torch.equal(p, before[n])]
    assert "score.weight" in changed and len(changed) > len(before) // 2


def test_the_reference_stays_the_initial_policy_after_resume(tiny_model, tmp_path):
    from safetensors.torch import load_file

    config = small(tiny_model, tmp_path, algo="grpo", iterations=2, algorithm={"kl_loss_coef": 0.1})
    Trainer(config).train()
    initial = load_file(str(tiny_model / "model.safetensors"))
    config.iterations = 3
    resumed = Trainer(config, resume=True)
    trained = load_file(str(tmp_path / "checkpoints" / "step-2" / "actor" / "model.safetensors"))
    reference = resumed.state.reference.state_dict()
    assert all(torch.equal(reference[k], initial[k]) for k in initial)  # not the resumed actor
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)
    actor = resumed.state.actor.state_dict()
    assert all(torch.equal(actor[k], trained[k]) for k in trained)


def test_later_mini_batches_are_off_policy(tiny_model, tmp_path):
    """Old log-probs come from before the update: after the first step the ratios leave 1 and clipping acts."""
    Trainer(small(tiny_model, tmp_path, logging=dict(step_diagnostics=True), optimizer=dict(actor_lr=5e-2))).train()
    record = read_metrics(tmp_path)[0]
    assert record["offpolicy/steps"] == 3 and record["offpolicy/clip_frac"] > 0
    assert record["offpolicy/tail/ratio_max"] > 1.2


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


# --- scoring and actions --------------------------------------------------------------------------------------

def test_f1_takes_the_best_of_several_golds_and_em_normalises_articles():
    golds = ["the Eiffel Tower", "Paris France", "tower"]
    assert f1_score("Eiffel Tower", golds) == 1.0  # the first gold (articles dropped), not the last
    assert f1_score("Paris", golds) == pytest.approx(2 / 3)
    assert f1_score("tower of pisa", ["pisa leaning", "tower"]) == pytest.approx(0.5)
    assert normalize_answer("The  Beatles!") == "beatles" and normalize_answer("an apple a day") == "apple day"
    assert exact_match("A Beatles", ["the beatles"]) == 1.0 and exact_match("Beatles band", ["Beatles"]) == 0.0


def test_two_blocks_in_one_action_take_the_first_complete_one_lazily():
    parsed = parse_action("<search> one </search> text <search> two </search>")
    assert parsed.type is ActionType.SEARCH and parsed.content == "one"  # not "one </search> ... <search> two"
    parsed = parse_action("<answer> A </answer><answer> B </answer>")
    assert parsed.content == "A"


# --- env: topk and the last turn -----------------------------------------------------------------------------

class CountingRetriever(KeywordRetriever):
    def __init__(self):
        super().__init__([(f"T{i}", f"text {i} paris") for i in range(10)])
        self.ks: list[int] = []

    def batch_search(self, queries, k=10):
        self.ks.append(k)
        return super().batch_search(queries, k)


@pytest.mark.parametrize("topk", [1, 2, 5])
def test_env_step_passes_topk_to_the_retriever(topk):
    from stppo_envs import SearchQAEnv

    retriever = CountingRetriever()
    env = SearchQAEnv("nq", retriever=retriever, topk=topk, max_turns=3)
    env.reset(options={"index": 0})
    observation, *_ = env.step("<search> paris </search>")
    assert retriever.ks == [topk] and observation.count("Doc ") == topk


def test_a_search_on_the_last_turn_is_not_served():
    from stppo_envs import SearchQAEnv

    retriever = CountingRetriever()
    env = SearchQAEnv("nq", retriever=retriever, max_turns=2)
    env.reset(options={"index": 0})
    env.step("<search> paris </search>")
    _, reward, terminated, truncated, info = env.step("<search> paris again </search>")
    assert len(retriever.ks) == 1 and truncated and not terminated and reward == 0.0


# --- rates by definition -------------------------------------------------------------------------------------

def test_rates_are_per_turn_and_per_search_not_per_episode():
    from stppo_agent.rollouts.episode_stats import episode_rates

    episodes = [{"turns": 4, "invalid_actions": 2, "search_calls": 1, "search_errors": 1, "answered": True},
                {"turns": 1, "invalid_actions": 0, "search_calls": 0, "search_errors": 0, "answered": False}]
    rates = episode_rates(episodes)
    assert rates["invalid_action_rate"] == pytest.approx(2 / 5)  # per turn (per episode would be 0.25)
    assert rates["search_error_rate"] == pytest.approx(1 / 2)  # per attempted search
    assert rates["answer_rate"] == pytest.approx(1 / 2)


def test_training_shows_progress_within_iterations(tiny_model, tmp_path, capsys):
    Trainer(small(tiny_model, tmp_path, logging=dict(progress=True))).train()
    err = capsys.readouterr().err
    for phase in ("rollout turn 1/2", "scoring", "update step 1/4", "update step 4/4"):
        assert phase in err, phase
