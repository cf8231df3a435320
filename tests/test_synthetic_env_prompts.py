"""Synthetic envs (stppo/Toy-v0 with a drawn target, stppo/Copy-v0) pose many prompts to a trainer: its prompt
sampler walks them, every sample of one prompt (a GRPO group) is posed the same question, and different prompts
differ. With one prompt per env, every toy episode a trainer played had the target "red"."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import gymnasium as gym
import pytest

import stppo_envs  # noqa: F401  (registers the env ids)
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.rollouts.envs import prompt_count
from stppo_agent.training.trainer import Trainer

from .test_trainer import toy_config


def test_prompt_count_of_each_kind_of_env():
    assert prompt_count(gym.make("stppo/Toy-v0", fixed_target=None)) == 4
    assert prompt_count(gym.make("stppo/Toy-v0")) == 1  # a fixed target is one prompt
    assert prompt_count(gym.make("stppo/Copy-v0", prompts=37)) == 37
    assert prompt_count(gym.make("stppo/NQ-v0")) == len(gym.make("stppo/NQ-v0").unwrapped.examples) > 1


def test_an_indexed_copy_episode_is_fixed_by_its_index_whatever_the_seed():
    env = gym.make("stppo/Copy-v0", prompts=10).unwrapped
    first, _ = env.reset(seed=1, options={"index": 3})
    again, _ = env.reset(seed=2, options={"index": 13})  # 13 modulo 10 prompts: the same question
    other, _ = env.reset(seed=1, options={"index": 4})
    unindexed_a, _ = env.reset(seed=1)
    unindexed_b, _ = env.reset(seed=2)
    assert first == again and first != other and unindexed_a != unindexed_b


def questions_by_group(batch) -> dict[int, set[str]]:
    groups = defaultdict(set)
    for group, info in zip(batch.group_ids.tolist(), batch.episode_info):
        groups[group].add(info["question"])
    return groups


@pytest.mark.parametrize("env, env_kwargs", [("stppo/Toy-v0", {"fixed_target": None}), ("stppo/Copy-v0", {})])
def test_a_trainer_poses_each_group_one_question_and_the_groups_different_ones(tmp_path: Path, env, env_kwargs):
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    batches = []
    config = toy_config(model, tmp_path / "run", "grpo", iterations=1, env=env, env_kwargs=env_kwargs,
                        rollout=dict(prompts_per_iteration=4, samples_per_prompt=3, max_new_tokens_per_turn=2,
                                     max_prompt_tokens=64, max_total_tokens=128),
                        optimizer=dict(mini_batch_size=12, micro_batch_size=12), monitor=dict(on_collapse="none"))
    Trainer(config, report=lambda _: None, batch_hook=batches.append).train()
    groups = questions_by_group(batches[0])
    assert len(groups) == 4 and all(len(questions) == 1 for questions in groups.values())
    # the toy's 4 targets are one epoch of its prompts: each is posed once; copy sequences differ group to group
    assert len(set.union(*groups.values())) == 4
