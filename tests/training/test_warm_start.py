"""init_from: a new run starts from another run's checkpoint -- its actor, critic and AdamW state -- instead of a
cold AdamW, whose first step moves every weight by about lr in the sign of its gradient. And warmup_steps: the
first step's learning rate is lr / warmup_steps, as logged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import merged
from stppo_agent.training.replay import replay
from stppo_agent.training.trainer import Trainer
from tests.support.cli_in_process import stppo
from tests.support.runs import TIMING, toy_config

LR = 1e-2


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory) -> Path:
    """Two iterations of PPO on the toy env, a checkpoint after each."""
    folder = tmp_path_factory.mktemp("warm")
    model = build_tiny_llama(folder / "model", word_tokenizer())
    Trainer(one_step_config(model, folder / "run", iterations=2, checkpoint=dict(every=1)),
            report=lambda _: None).train()
    return folder / "run"


def one_step_config(model, out: Path, **overrides):
    """One optimizer step per iteration (the whole batch is one mini-batch)."""
    values = dict(iterations=1, rollout=dict(prompts_per_iteration=4, samples_per_prompt=4),
                  optimizer=dict(mini_batch_size=16, micro_batch_size=8, epochs=1, actor_lr=LR, critic_lr=LR),
                  monitor=dict(on_collapse="none"))
    values = merged(values, overrides)
    return toy_config(model, out, "ppo", **values)


def warm_config(warm_run: Path, out: Path, **overrides):
    model = overrides.pop("model", "")  # unset: the checkpoint's actor
    return one_step_config(model, out, **{"init_from": str(warm_run / "checkpoints" / "step-2"), **overrides})


def actor_weights(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.state.actor.named_parameters()}


def test_a_warm_start_holds_the_checkpoints_weights_and_moments_at_iteration_zero(warm_run, tmp_path):
    checkpoint = warm_run / "checkpoints" / "step-2"
    warm = Trainer(warm_config(warm_run, tmp_path / "warm", optimizer=dict(warmup_steps=4)), report=lambda _: None)
    resumed = Trainer(one_step_config(str(warm_run.parent / "model"), warm_run, iterations=3), resume=True,
                      report=lambda _: None)  # the same checkpoint, as --resume restores it
    assert warm.state.iteration == 0 and warm.state.optimizer_steps == 0
    assert warm.config.model == str(checkpoint / "actor")  # unset: the warm start's actor is the reference too
    for mine, theirs in ((warm.state.actor, resumed.state.actor), (warm.state.critic, resumed.state.critic)):
        assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), theirs.state_dict().values()))
    for mine, theirs in ((warm.state.actor_optimizer, resumed.state.actor_optimizer),
                         (warm.state.critic_optimizer, resumed.state.critic_optimizer)):
        a, b = mine.state_dict()["state"], theirs.state_dict()["state"]
        assert a.keys() == b.keys() and len(a) > 0
        for key in a:
            assert float(a[key]["step"]) == float(b[key]["step"]) == 2.0
            assert torch.equal(a[key]["exp_avg"], b[key]["exp_avg"])
            assert torch.equal(a[key]["exp_avg_sq"], b[key]["exp_avg_sq"])
    # this run's own schedule from its first step: lr / warmup_steps, not the old run's rate
    assert [g["lr"] for g in warm.state.actor_optimizer.param_groups] == [LR / 4]
    assert [g["lr"] for g in warm.state.critic_optimizer.param_groups] == [LR / 4]


def test_the_first_step_from_warm_moments_is_no_sign_step(warm_run, tmp_path):
    checkpoint = warm_run / "checkpoints" / "step-2"
    changes = {}
    cold = one_step_config(str(checkpoint / "actor"), tmp_path / "cold", critic_model=str(checkpoint / "critic"))
    for name, config in (("warm", warm_config(warm_run, tmp_path / "warm")), ("cold", cold)):
        trainer = Trainer(config, report=lambda _: None)
        before = actor_weights(trainer)
        trainer.train()
        after = actor_weights(trainer)
        changes[name] = torch.cat([(after[k] - before[k]).abs().reshape(-1) for k in before]) / LR
    # a cold AdamW's first step is lr * g / |g|: every weight that has a gradient moves by lr
    moved = changes["cold"][changes["cold"] > 1e-3]
    assert float(moved.median()) == pytest.approx(1.0, abs=0.02)
    # the warm moments weigh this gradient against the warm start's: most weights move by less (half, here)
    assert float(changes["warm"].median()) < 0.75 * float(changes["cold"].median())


def test_a_warm_started_run_records_resumes_and_replays_exactly(warm_run, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    Trainer(warm_config(warm_run, straight, iterations=3, logging=dict(save_rollouts=True)),
            report=lambda _: None).train()
    recorded = yaml.safe_load((straight / "config.yaml").read_text())
    assert recorded["init_from"] == str(warm_run / "checkpoints" / "step-2")
    Trainer(warm_config(warm_run, stopped, iterations=2, checkpoint=dict(every=1)), report=lambda _: None).train()
    Trainer(warm_config(warm_run, stopped, iterations=3), resume=True, report=lambda _: None).train()
    replay(straight, None, str(tmp_path / "replayed"), report=lambda _: None)
    a, b, c = read_metrics(straight), read_metrics(stopped), read_metrics(tmp_path / "replayed")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [r["step"] for r in c] == [1, 2, 3]
    for x, y, z in zip(a, b, c):
        for key in sorted(set(x) - TIMING):
            assert x[key] == y[key], ("resume", x["step"], key)
            if key in z:  # the replay's own diagnostics add keys; the shared ones match
                assert x[key] == z[key], ("replay", x["step"], key)


def test_a_resume_does_not_need_the_warm_start_again(warm_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(warm_run / "checkpoints" / "step-2", copy)
    config = one_step_config("", tmp_path / "run", init_from=str(copy), iterations=1)
    Trainer(config, report=lambda _: None).train()
    shutil.rmtree(copy)
    config.iterations = 2
    Trainer(config, resume=True, report=lambda _: None).train()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_unusable_warm_starts_are_refused_before_any_model_loads(warm_run, tmp_path):
    checkpoint = warm_run / "checkpoints" / "step-2"
    with pytest.raises(ValueError, match=r"^init_from .* is not a checkpoint folder"):
        Trainer(warm_config(warm_run, tmp_path / "a", init_from=str(warm_run)), report=lambda _: None)
    no_critic = tmp_path / "no_critic"
    shutil.copytree(checkpoint, no_critic)
    shutil.rmtree(no_critic / "critic")
    with pytest.raises(ValueError, match=r"holds no critic \(its run trained none\) but algo ppo trains one"):
        Trainer(warm_config(warm_run, tmp_path / "b", init_from=str(no_critic)), report=lambda _: None)
    with pytest.raises(ValueError, match=r"^init_from loads the critic from the checkpoint; unset critic_model"):
        warm_config(warm_run, tmp_path / "c", critic_model=str(checkpoint / "critic")).validate()
    other = build_tiny_llama(tmp_path / "other", word_tokenizer(), hidden=16)
    with pytest.raises(ValueError, match=r"\(the reference policy\) is not the architecture of the actor of"):
        Trainer(warm_config(warm_run, tmp_path / "d", model=str(other), algorithm={"kl_in_reward": 0.001}),
                report=lambda _: None)


def test_a_checkpoint_without_optimizer_state_is_refused(tmp_path):
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    Trainer(one_step_config(model, tmp_path / "run", iterations=2, checkpoint=dict(every=1, optimizer="newest")),
            report=lambda _: None).train()
    older = tmp_path / "run" / "checkpoints" / "step-1"
    refusal = r"holds no optimizer state \(checkpoint.optimizer=newest keeps it in the newest checkpoint only\)"
    with pytest.raises(ValueError, match=refusal):
        Trainer(one_step_config("", tmp_path / "new", init_from=str(older)), report=lambda _: None)


def test_the_command_line_starts_from_a_checkpoint_without_a_model(warm_run, tmp_path, capsys):
    result = stppo("train", "--algo", "ppo", "--env", "stppo/Toy-v0", "--output-dir", str(tmp_path / "run"),
                   "--iterations", "1", "--set", f"init_from={warm_run / 'checkpoints' / 'step-2'}",
                   "--set", "rollout.prompts_per_iteration=2", "--set", "rollout.samples_per_prompt=2", "--set",
                   "rollout.max_turns=2",
                   "--set", "rollout.max_new_tokens_per_turn=1", "--set", "rollout.max_prompt_tokens=8", "--set",
                   "rollout.max_total_tokens=32",
                   "--set", "logging.progress=false", "--set", "logging.tensorboard=false", capsys=capsys)
    assert result.returncode == 0, result.stderr
    assert "started from" in result.stdout + result.stderr
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"].endswith("step-2/actor")


def test_warm_up_starts_at_lr_over_warmup_steps_and_logs_the_rate_each_iteration_used(tmp_path):
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    trainer = Trainer(one_step_config(model, tmp_path / "run", iterations=4, optimizer=dict(warmup_steps=3)),
                      report=lambda _: None)
    used = []
    trainer.state.actor_optimizer.register_step_pre_hook(
        lambda optimizer, *_: used.append(optimizer.param_groups[0]["lr"]))
    trainer.train()
    expected = [LR / 3, 2 * LR / 3, LR, LR]
    assert used == pytest.approx(expected, rel=1e-12)
    assert [r["actor_lr"] for r in read_metrics(tmp_path / "run")] == pytest.approx(expected, rel=1e-12)
