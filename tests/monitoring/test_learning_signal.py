"""``stppo_agent.monitoring.learning_signal``: an iteration with no
learning signal is said once, with the likely cause and what to try."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from stppo_agent.monitoring.learning_signal import LearningSignalNotice, advice, no_signal_reason
from stppo_agent.training.config import TrainConfig, from_dict, merged
from stppo_agent.training.config_sections import RolloutConfig
from stppo_agent.training.trainer import Trainer
from tests.support.monitoring import config
from tests.support.paths import REPO

# -- learning signal -----------------------------------------------------------------------------------------------
TWO_TOKEN_MASK = torch.ones(4, 2, dtype=torch.bool)
GROUPS = torch.tensor([0, 0, 1, 1])


def no_signal(rewards, group_relative=False, advantages=None, mask=TWO_TOKEN_MASK):
    return no_signal_reason(torch.tensor(rewards), GROUPS, advantages, mask, group_relative)


def test_no_signal_reason_boundaries():
    assert no_signal([0.5, 0.5, 0.5, 0.5 + 9e-7]) == "every trajectory earned the same reward (0.500)"
    assert no_signal([0.5, 0.5, 0.5, 0.5 + 1e-5]) is None
    assert no_signal([1e-6] * 4) == "every trajectory's reward is 0"
    assert no_signal([1e-5] * 4) == "every trajectory earned the same reward (0.000)"
    assert no_signal_reason(torch.zeros(1), torch.zeros(1), None, torch.ones(1, 2, dtype=torch.bool), False) == \
        "every trajectory's reward is 0"  # a batch of one
    assert no_signal([-1.0] * 4) == "every trajectory earned the same reward (-1.000)"  # a penalty is not 0
    assert no_signal([0.3, 0.3 + 1e-7, 0.7, 0.7], group_relative=True).startswith("within every group")
    assert no_signal([0.3, 0.3 + 1e-5, 0.7, 0.7], group_relative=True) is None
    varied = [1.0, 0.0, 0.5, 0.0]
    tiny = torch.full((4, 2), 1e-12)
    assert no_signal(varied, advantages=tiny) == "every token's advantage is 0"
    assert no_signal(varied, advantages=torch.full((4, 2), 1e-10)) is None
    masked_out = torch.zeros(4, 2)
    masked_out[:, 1] = 1.0  # advantages only where the loss does not look
    half = torch.zeros(4, 2, dtype=torch.bool)
    half[:, 0] = True
    assert no_signal(varied, advantages=masked_out, mask=half) == "every token's advantage is 0"
    assert no_signal(varied, advantages=masked_out, mask=~half) is None
    assert no_signal(varied, advantages=torch.ones(4, 2), mask=torch.zeros(4, 2, dtype=torch.bool)) == \
        "every token's advantage is 0"
    assert no_signal_reason(torch.zeros(0), torch.zeros(0), None, torch.zeros(0, 2, dtype=torch.bool), False) is None


def test_advice_texts():
    solved = advice("every trajectory earned the same reward (1.000)", config())
    assert solved == ("no learning signal: every trajectory earned the same reward (1.000), so this update cannot "
                      "learn the task. Likely cause: the task is already solved (or always paid the same) at these "
                      "settings (rollout.max_turns=3, rollout.max_new_tokens_per_turn=4, rollout.temperature=0.7, "
                      "rollout.samples_per_prompt=5). "
                      "Try a harder dataset or split, or a reward that tells answers apart (--set "
                      "env_kwargs.reward=f1). (Said once; metrics.jsonl keeps the per-iteration figures.)")
    toy = advice("every trajectory's reward is 0", config())
    assert toy.startswith("no learning signal: every trajectory's reward is 0, so this update cannot learn the task. "
                          "Likely cause: the model never (or always) produces a rewarded action at these settings "
                          "(rollout.max_turns=3, ")
    assert "Try longer turns (--set rollout.max_new_tokens_per_turn=...), more samples (--set " \
           "rollout.samples_per_prompt=...), a model whose vocabulary holds the env's words (--model tiny on " \
           "stppo/Toy-v0)." in toy
    mixed = advice("every trajectory's reward is 0", config(" stppo/Toy-v0, stppo/NQ-v0 ,"))
    assert "a shaped reward (--set env_kwargs.format_reward=0.2), a warm start (stppo sft)." in mixed


def fake_batch(rewards) -> SimpleNamespace:
    return SimpleNamespace(rewards=torch.tensor(rewards), group_ids=GROUPS, advantages=None, loss_mask=TWO_TOKEN_MASK)


def signal_notice(advantage: str = "grpo", world: int = 1) -> tuple[LearningSignalNotice, list[str]]:
    """A notice and what it reports, for a run on the CPU."""
    from stppo_agent.algorithms import ALGORITHMS

    said: list[str] = []
    algo = dataclasses.replace(ALGORITHMS["grpo"], advantage=advantage)
    return LearningSignalNotice(config(), algo, said.append, world, torch.device("cpu")), said


def test_notice_once_per_run_after_a_batch_with_signal():
    notice, said = signal_notice()
    notice.check(fake_batch([1.0, 0.0, 1.0, 0.0]), 4)
    assert said == []
    notice.check(fake_batch([1.0, 1.0, 0.0, 0.0]), 4)  # grpo: equal inside every group
    assert said == [f"iteration 5: {advice(no_signal([1.0, 1.0, 0.0, 0.0], True), notice.config)}"]
    notice.check(fake_batch([0.0] * 4), 5)
    assert len(said) == 1
    critic, critic_said = signal_notice("gae")  # a critic learns from groups that differ
    critic.check(fake_batch([1.0, 1.0, 0.0, 0.0]), 4)
    assert critic_said == []
    ranks, ranks_said = signal_notice(world=2)  # one process alone: its own batch decides (the all-reduce: identity)
    ranks.check(fake_batch([0.0] * 4), 4)
    assert len(ranks_said) == 1 and "every trajectory's reward is 0" in ranks_said[0]
    paid, paid_said = signal_notice(world=2)
    paid.check(fake_batch([1.0, 0.0, 1.0, 0.0]), 4)
    assert paid_said == []
    flat_advantages = fake_batch([1.0, 0.0, 0.5, 0.0])
    flat_advantages.advantages = torch.zeros(4, 2)
    unlucky, unlucky_said = signal_notice("gae")  # a critic's advantages that came out all 0
    unlucky.check(flat_advantages, 4)
    assert len(unlucky_said) == 1 and "every token's advantage is 0" in unlucky_said[0]


def test_notice_across_processes_asks_every_rank_once(monkeypatch):
    from stppo_agent.distributed import process_group

    sums, others = [], [0.0]

    def all_reduce_sum(value):
        sums.append((value.device, value.shape))
        return torch.tensor(others[0])  # what the other ranks add: one of them had a signal or none did

    monkeypatch.setattr(process_group, "all_reduce_sum", all_reduce_sum)
    alone, alone_said = signal_notice()
    alone.check(fake_batch([0.0] * 4), 4)
    assert sums == [] and len(alone_said) == 1  # a single process makes no collective call
    ranks, ranks_said = signal_notice(world=2)
    ranks.device = torch.device("meta")  # the collective runs on the run's device (NCCL wants CUDA tensors)
    ranks.check(fake_batch([0.0] * 4), 4)
    assert sums == [(torch.device("meta"), torch.Size([]))] and len(ranks_said) == 1
    others[0] = 1.0
    rescued, rescued_said = signal_notice(world=2)
    rescued.check(fake_batch([0.0] * 4), 4)  # another rank's batch had a signal: silent
    assert rescued_said == [] and len(sums) == 2


# An iteration with no learning signal is said once, with the likely cause and what to try.


MASK = torch.ones(4, 3, dtype=torch.bool)


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
