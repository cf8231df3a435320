"""An iteration with no learning signal is said once, with the likely cause and what to try (issue 31.3)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from stppo_agent.monitoring.learning_signal import advice, no_signal_reason
from stppo_agent.training.config import TrainConfig, from_dict, merged
from stppo_agent.training.config_sections import RolloutConfig
from stppo_agent.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
MASK = torch.ones(4, 3, dtype=torch.bool)
GROUPS = torch.tensor([0, 0, 1, 1])


def reason(rewards, group_relative=False, advantages=None, groups=GROUPS):
    return no_signal_reason(torch.tensor(rewards), groups, advantages, MASK, group_relative)


def test_equal_rewards_everywhere_have_no_signal_for_every_estimator():
    assert reason([0.0, 0.0, 0.0, 0.0]) == "every trajectory's reward is 0"
    assert reason([0.0, 0.0, 0.0, 0.0], group_relative=True) == "every trajectory's reward is 0"
    assert "same reward (1.000)" in reason([1.0, 1.0, 1.0, 1.0])
    assert reason([0.5, 0.5, 0.5, 0.5 + 1e-8]) is not None  # float noise is no signal


def test_groups_equal_inside_but_different_across():
    # a group-relative estimator learns nothing from it; a critic-based one can (prompts differ in value)
    assert "within every group" in reason([1.0, 1.0, 0.0, 0.0], group_relative=True)
    assert reason([1.0, 1.0, 0.0, 0.0], group_relative=False) is None
    assert reason([1.0, 0.0, 0.0, 0.0], group_relative=True) is None  # one group disagrees: a signal


def test_zero_advantages_are_no_signal_even_with_varied_rewards():
    assert reason([1.0, 0.0, 0.5, 0.0], advantages=torch.zeros(4, 3)) == "every token's advantage is 0"
    assert reason([1.0, 0.0, 0.5, 0.0], advantages=torch.full((4, 3), 0.1)) is None


def test_the_advice_names_the_settings_and_what_to_try():
    config = TrainConfig(model="m", env="stppo/NQ-v0",
                         rollout=RolloutConfig(max_new_tokens_per_turn=2, samples_per_prompt=2))
    text = advice("every trajectory's reward is 0", config)
    assert "never (or always) produces a rewarded action" in text
    assert "rollout.max_new_tokens_per_turn=2" in text and "rollout.samples_per_prompt=2" in text
    assert "env_kwargs.format_reward" in text and "--model tiny" not in text
    toy = advice("every trajectory's reward is 0", TrainConfig(model="m", env="stppo/Toy-v0"))
    assert "--model tiny" in toy and "format_reward" not in toy  # the toy env takes no format reward


def small_toy(out: Path, **overrides) -> TrainConfig:
    values = dict(algo="grpo", env="stppo/Toy-v0", model="tiny", output_dir=str(out), iterations=3,
                  rollout=dict(prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens_per_turn=1,
                               max_prompt_tokens=8, max_total_tokens=32),
                  optimizer=dict(mini_batch_size=8, micro_batch_size=8),
                  logging=dict(progress=False, tensorboard=False), checkpoint=dict(every=100))
    values = merged(values, overrides)
    from stppo_agent.models.default_model import resolve_model

    values["model"] = resolve_model(values["model"])
    return from_dict(values)


def test_the_trainer_says_it_once_per_run(tmp_path):
    said: list[str] = []

    def no_reward(batch):
        batch.rewards.zero_()

    Trainer(small_toy(tmp_path / "flat"), report=said.append, batch_hook=no_reward).train()
    notices = [line for line in said if "no learning signal" in line]
    assert len(notices) == 1 and notices[0].startswith("iteration 1: "), said


def test_a_paid_run_says_nothing(tmp_path):
    said: list[str] = []
    Trainer(small_toy(tmp_path / "paid", iterations=1, rollout=dict(samples_per_prompt=4)), report=said.append).train()
    assert not [line for line in said if "no learning signal" in line], said


def test_stppo_train_says_it_for_a_target_the_model_cannot_say(tmp_path):
    """As a user meets it: the tiny model's vocabulary lacks 'purple', so no trajectory is ever paid."""
    command = [sys.executable, "-m", "stppo_agent.cli", "train", "--algo", "grpo", "--env", "stppo/Toy-v0",
               "--model", "tiny", "--output-dir", str(tmp_path / "run"), "--iterations", "2",
               "--set", "env_kwargs.choices=[purple,orange]", "--set", "env_kwargs.fixed_target=purple",
               "--set", "rollout.samples_per_prompt=2", "--set", "rollout.prompts_per_iteration=2", "--set",
               "optimizer.mini_batch_size=4",
               "--set", "optimizer.micro_batch_size=4", "--set", "rollout.max_new_tokens_per_turn=1", "--set",
               "logging.tensorboard=false"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("no learning signal") == 1, done.stdout
    assert "iteration 1: no learning signal: every trajectory's reward is 0" in done.stdout


def test_model_tiny_is_built_once_deterministically_and_spelt_checked(tmp_path, monkeypatch):
    import pytest
    from safetensors.torch import load_file

    from stppo_agent.models.default_model import resolve_model
    from stppo_agent.plugins.name_checks import check_model

    folders = []
    for cache in ("a", "b"):  # two machines' caches build the same weights
        monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / cache))
        folders.append(Path(resolve_model("tiny")))
        assert folders[-1].is_relative_to(tmp_path / cache) and (folders[-1] / "tokenizer.json").exists()
    first, second = (load_file(folder / "model.safetensors") for folder in folders)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    stamp = (folders[1] / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("hf:tiny") == str(folders[1])
    assert (folders[1] / "model.safetensors").stat().st_mtime_ns == stamp  # built once, then reused
    check_model("tiny")
    with pytest.raises(ValueError, match="did you mean tiny"):
        check_model("tinny")
