"""stppo/Copy-v0: Gymnasium's checker and the repository's generic env checks, partial credit per position, real
invalid actions, the copy tier's tokenizer (one token per symbol) and its supervised warm start."""

from __future__ import annotations

import sys

import gymnasium as gym
import pytest

from stppo_envs.copy_task import COPY_ENV_ID, CopyEnv, copy_symbols
from tests.envs import test_registered_envs as generic
from tests.support.paths import REPO


def test_registered_and_passes_the_generic_env_checks():
    assert COPY_ENV_ID == "stppo/Copy-v0" and COPY_ENV_ID in gym.registry
    generic.test_gymnasium_env_checker(COPY_ENV_ID)
    generic.test_seeded_double_rollout_is_identical(COPY_ENV_ID)
    generic.test_pickled_env_continues_identically(COPY_ENV_ID)


def play(env: CopyEnv, actions) -> list[tuple]:
    return [env.step(action) for action in actions]


def test_each_turn_shows_a_sequence_and_a_perfect_copy_scores_one():
    env = gym.make(COPY_ENV_ID).unwrapped
    prompt, info = env.reset(seed=4)
    first, second = env.sequences
    assert prompt == "copy " + " ".join(first) and len(first) == 16 and set(first) <= set(copy_symbols(64))
    assert info["benchmark"] == "copy" and info["messages"] == [{"role": "user", "content": prompt}]
    observation, reward, terminated, truncated, info = env.step(" ".join(first))
    assert observation.split() == ["copy", *second]
    assert (reward, terminated, truncated, info["accuracy"], info["invalid_actions"]) == (0.0, False, False, 1.0, 0)
    _, reward, terminated, _, info = env.step(" ".join(second))
    assert (reward, terminated, info["em"], info["f1"], info["action_type"]) == (1.0, True, 1.0, 1.0, "answer")
    assert info["golden_answers"] == [" ".join(second)]
    with pytest.raises(RuntimeError, match="reset"):
        env.step(" ".join(second))


def test_reward_is_the_mean_per_position_accuracy_over_turns():
    env = CopyEnv(length=4, vocabulary=8, turns=2)
    env.reset(seed=1)
    first, second = env.sequences
    wrong = [next(s for s in env.symbols if s != t) for t in second]
    results = play(env, [" ".join(first[:3] + ("s00" if first[3] != "s00" else "s01",)),  # 3 of 4 right
                         " ".join(wrong[:2] + list(second[2:3]) + wrong[3:])])  # 1 of 4 right
    assert [r[4]["accuracy"] for r in results] == [0.75, 0.25]
    assert results[-1][1] == pytest.approx((0.75 + 0.25) / 2) and results[-1][4]["em"] == 0.0


def test_wrong_length_or_a_word_outside_the_symbols_is_an_invalid_action_and_keeps_its_partial_credit():
    env = CopyEnv(length=4, vocabulary=8, turns=3)
    env.reset(seed=2)
    first, second, third = env.sequences
    results = play(env, [" ".join(first[:3]),  # one word short: the three present are right
                         " ".join((*second[:3], "s99")),  # s99 is not one of 8 symbols
                         " ".join(third)])
    assert [r[4]["action_type"] for r in results] == ["invalid", "invalid", "answer"]
    assert [r[4]["invalid_actions"] for r in results] == [1, 2, 2]
    assert [r[4]["accuracy"] for r in results] == [0.75, 0.75, 1.0]
    assert results[-1][1] == pytest.approx(2.5 / 3)
    env.reset(seed=2)
    assert play(env, [" ".join((*first, first[0]))])[0][4]["invalid_actions"] == 1  # one word too many


def test_a_random_policy_scores_about_one_over_the_vocabulary():
    env = CopyEnv()
    rewards = []
    for seed in range(200):
        env.reset(seed=seed)
        guess = env.np_random.choice(env.symbols, size=(2, 16))
        rewards.append(play(env, [" ".join(row) for row in guess])[-1][1])
    assert sum(rewards) / len(rewards) == pytest.approx(1 / 64, abs=0.006)


@pytest.mark.parametrize("kwargs,message", [({"length": 0}, "length >= 1"), ({"vocabulary": 1}, "vocabulary"),
                                            ({"turns": 0}, "turns >= 1"), ({"render_mode": "human"}, "render_mode")])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CopyEnv(**kwargs)


def test_the_copy_tokenizer_gives_one_token_per_symbol_and_decodes_a_turn_to_its_words():
    from stppo_agent.models.tiny import copy_tokenizer

    tokenizer = copy_tokenizer()
    symbols = copy_symbols(64)
    ids = tokenizer(" ".join(symbols), add_special_tokens=False)["input_ids"]
    assert len(ids) == 64 and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids[:16], skip_special_tokens=True).split() == list(symbols[:16])


def test_the_supervised_warm_start_stops_at_its_target_and_rollouts_score_near_it(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from copy_warm_start import warm_start
    from transformers import AutoTokenizer

    from stppo_agent.models.loading import load_actor
    from stppo_agent.models.tiny import build_copy_llama
    from stppo_agent.rollouts.hf_generation import HFGenerationBackend
    from stppo_agent.rollouts.turn_loop import RolloutLimits, collect_rollouts

    base = build_copy_llama(tmp_path / "random")
    info = warm_start(str(base), tmp_path / "warm", target=0.3, lr=2e-3)
    assert 0.3 <= info["sampled_accuracy"] < 0.6 and info["steps"] > 0
    assert warm_start(str(base), tmp_path / "warm", target=0.3)["steps"] == info["steps"]  # done once, then read
    model, tokenizer = load_actor(str(tmp_path / "warm")), AutoTokenizer.from_pretrained(tmp_path / "warm")
    envs = [CopyEnv() for _ in range(32)]
    batch = collect_rollouts(HFGenerationBackend(model, tokenizer), tokenizer, envs, [{}] * 32, list(range(32)),
                             RolloutLimits(max_turns=2, max_new_tokens_per_turn=16, max_observation_tokens=17,
                                           max_prompt_tokens=17, max_total_tokens=80), seeds=list(range(32)))
    assert 0.15 < batch.stats["reward"] < 0.6  # the teacher-forced estimate is what sampling gets, roughly
    assert batch.stats["reward"] > 4 / 64  # far above the random model's 1/64
