"""`stppo train` reads the train split unless env_kwargs.split names another (a search env alone serves its
evaluation split, which is what eval wants and training must not take)."""

from __future__ import annotations

import yaml

from stppo_agent.rollouts.envs import make_env
from stppo_agent.training.config import TrainConfig, from_dict, merged
from stppo_agent.training.config_sections import LoggingConfig
from stppo_agent.training.trainer import Trainer
from stppo_agent.training.training_split import with_training_split


def config(**overrides) -> TrainConfig:
    values = dict(model="m", env="stppo/NQ-v0,stppo/HotpotQA-v0")
    values = merged(values, overrides)
    return from_dict(values)


def test_a_new_run_on_search_envs_trains_on_the_train_split():
    resolved = with_training_split(config(env_kwargs={"topk": 2}), previous=None)
    assert resolved.env_kwargs == {"topk": 2, "split": "train"}


def test_an_explicit_split_wins_and_the_users_config_is_not_mutated():
    given = config(env_kwargs={"split": "test"})
    assert with_training_split(given, previous=None).env_kwargs == {"split": "test"}
    plain = config()
    with_training_split(plain, previous=None)
    assert plain.env_kwargs == {}


def test_envs_without_splits_are_left_alone():
    assert with_training_split(config(env="stppo/Toy-v0"), previous=None).env_kwargs == {}


def test_a_run_started_without_a_split_resumes_on_the_split_it_started_with():
    said = []
    resumed = with_training_split(config(), previous={"env_kwargs": {"topk": 3}}, report=said.append)
    assert resumed.env_kwargs == {}  # the checkpoint's prompt position indexes the evaluation split's examples
    assert "evaluation" in said[0] and "train split" in said[0]
    assert with_training_split(config(), previous={"env_kwargs": {"split": "train"}}).env_kwargs == {"split": "train"}


def test_the_trainer_plays_train_questions_and_records_the_split(tiny_model, tmp_path):
    trainer = Trainer(TrainConfig(model=str(tiny_model), env="stppo/NQ-v0", output_dir=str(tmp_path), iterations=1,
                                  logging=LoggingConfig(progress=False, tensorboard=False)), report=lambda _: None)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["env_kwargs"]["split"] == "train"
    env = make_env("stppo/NQ-v0", trainer.source.env_kwargs[0])
    ids = {example.id for example in env.examples}
    test_ids = {example.id for example in make_env("stppo/NQ-v0", {}).examples}  # gym.make's default: test
    assert env.split == "train" and ids and test_ids and not ids & test_ids
