"""What --resume does with settings that differ from the checkpoint's, and the learning rate across rollbacks
(issue 33, items 4 and 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stppo_agent.cli import main
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.runs.checkpoint import load_trainer_state
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import merged
from stppo_agent.training.trainer import Trainer

from .test_trainer import toy_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


def small(model: Path, out: Path, iterations: int, **overrides):
    values = dict(iterations=iterations, checkpoint=dict(every=1, keep=2),
                  rollout=dict(prompts_per_iteration=2, samples_per_prompt=2),
                  optimizer=dict(mini_batch_size=4, micro_batch_size=2), monitor=dict(on_collapse="none"))
    values = merged(values, overrides)
    return toy_config(model, out, "ppo", **values)


def cli(model: Path, out: Path, iterations: int, *extra: str) -> list[str]:
    settings = ["rollout.prompts_per_iteration=2", "rollout.samples_per_prompt=2", "optimizer.mini_batch_size=4",
                "optimizer.micro_batch_size=2",
                "optimizer.epochs=2", "optimizer.actor_lr=3e-3", "optimizer.critic_lr=3e-3", "rollout.max_turns=2",
                "rollout.max_new_tokens_per_turn=1",
                "rollout.max_prompt_tokens=8", "rollout.max_total_tokens=32", "logging.progress=false",
                "logging.tensorboard=false",
                "checkpoint.every=1", "monitor.on_collapse=none", "algorithm.kl_in_reward=0",
                "algorithm.kl_loss_coef=0"]
    return ["train", "--algo", "ppo", "--env", "stppo/Toy-v0", "--model", str(model), "--output-dir", str(out),
            "--iterations", str(iterations), *[x for s in settings for x in ("--set", s)], *extra]


def test_resume_applies_new_learning_rates_and_weight_decay_and_says_what_changed(tiny_model, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(cli(tiny_model, out, 2)) == 0
    capsys.readouterr()
    assert main(["train", "--output-dir", str(out), "--iterations", "3", "--resume", "--set", "optimizer.actor_lr=1e-3",
                 "--set", "optimizer.critic_lr=2e-3", "--set", "optimizer.weight_decay=0.01"]) == 0
    said = capsys.readouterr().out
    assert "optimizer.actor_lr 0.003 -> 0.001" in said and "optimizer.critic_lr 0.003 -> 0.002" in said, said
    assert "optimizer.weight_decay 0.0 -> 0.01" in said and "iterations 2 -> 3" in said, said
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["actor_lr"] == pytest.approx(3e-3) and records[2]["actor_lr"] == pytest.approx(1e-3)
    assert yaml.safe_load((out / "config.yaml").read_text())["optimizer"]["actor_lr"] == pytest.approx(1e-3)
    tensors, state = load_trainer_state(out / "checkpoints" / "step-3")
    for name, lr in (("actor", 1e-3), ("critic", 2e-3)):
        groups = tensors[f"{name}_optimizer"]["param_groups"]
        assert all(g["lr"] == pytest.approx(lr) and g["weight_decay"] == 0.01 for g in groups), groups
        assert tensors[f"{name}_scheduler"]["base_lrs"] == [pytest.approx(lr)]
    assert state["config"]["optimizer"]["actor_lr"] == pytest.approx(1e-3)  # what the checkpoint was trained with


def test_resume_refuses_settings_that_cannot_change_with_one_line_saying_why(tiny_model, tmp_path, capsys):
    out = tmp_path / "run"
    Trainer(small(tiny_model, out, 1)).train()
    said = []  # a resume that asks for no more iterations than were done says so instead of nothing
    assert Trainer(small(tiny_model, out, 1), resume=True, report=said.append).train() == {}
    assert any(line.startswith("nothing to train:") and "iteration 1" in line and "--iterations 2" in line
               for line in said), said
    refusals = {"seed=7": "seed", "env=stppo/NQ-v0": "env", "algorithm.use_critic=false": "algorithm.use_critic",
                "precision.dtype=bfloat16": "precision.dtype", "logging.save_rollouts=true": "logging.save_rollouts"}
    for setting, field in refusals.items():
        with pytest.raises(ValueError, match=f"--resume cannot change {field}") as caught:
            Trainer(small(tiny_model, out, 2, **dict([_parsed(setting)])), resume=True, report=lambda _: None)
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="--resume cannot change algo .ppo -> grpo."):
        Trainer(toy_config(tiny_model, out, "grpo", iterations=2, checkpoint=dict(every=1),
                           rollout=dict(prompts_per_iteration=2, samples_per_prompt=2),
                           optimizer=dict(mini_batch_size=4, micro_batch_size=2), monitor=dict(on_collapse="none")),
                resume=True, report=lambda _: None)
    capsys.readouterr()
    assert main(["train", "--output-dir", str(out), "--iterations", "2", "--resume", "--set", "seed=7"]) == 1
    err = capsys.readouterr().err
    assert "Loading weights" not in err  # refused before any model loads
    assert err.count("\n") == 1 and "--resume cannot change seed (0 -> 7)" in err
    assert [r["step"] for r in read_metrics(out)] == [1]  # nothing ran, nothing was rewritten


def _parsed(setting: str):
    key, _, raw = setting.partition("=")
    value = yaml.safe_load(raw)
    section, _, field = key.partition(".")
    if section == "algorithm":
        return "algorithm", {"kl_in_reward": 0.0, "kl_loss_coef": 0.0, field: value}
    return (section, {field: value}) if field else (key, value)


def test_rollbacks_compound_the_learning_rate_cut_and_resume_keeps_it(tiny_model, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(small(tiny_model, out, 2, optimizer=dict(actor_lr=3e-3)), report=lambda _: None)
    trainer.train()
    rates = []
    assert trainer.config.monitor.rollback_lr_factor == 0.5
    for _ in range(3):  # every rollback goes back to the same checkpoint, whose own rate is the original one
        scale = trainer.roll_back(1)["collapse/lr_scale"]
        state = trainer.state
        rates.append((scale, state.actor_scheduler.get_last_lr()[0], state.actor_optimizer.param_groups[0]["lr"]))
    assert [r[0] for r in rates] == [0.5, 0.25, 0.125]
    for _, last, group in rates:
        assert last == group
    assert [r[1] for r in rates] == [pytest.approx(x) for x in (1.5e-3, 7.5e-4, 3.75e-4)]
    trainer.save()  # what the guard does right after a rollback; kill -9 here, then --resume
    resumed = Trainer(small(tiny_model, out, 3, optimizer=dict(actor_lr=3e-3)), resume=True, report=lambda _: None)
    assert resumed.state.actor_optimizer.param_groups[0]["lr"] == pytest.approx(3.75e-4)
    assert resumed.state.actor_scheduler.base_lrs == [pytest.approx(3.75e-4)]
    resumed.train()
    assert read_metrics(out)[-1]["actor_lr"] == pytest.approx(3.75e-4)
    # a new actor_lr on resume is the rate used from then on: the rollbacks' cut was a cut of the old one
    again = Trainer(small(tiny_model, out, 4, optimizer=dict(actor_lr=1e-4)), resume=True, report=lambda _: None)
    assert again.state.actor_optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)


def test_a_recording_run_keeps_its_sampling_on_resume_and_a_plain_run_may_change_it(tiny_model, tmp_path):
    """stppo replay reads temperature & co. from the run's config.yaml for every recorded iteration: a resume that
    changed them would have the replay recompute the earlier iterations' log-probs at the new temperature."""
    recorded = tmp_path / "recorded"
    Trainer(small(tiny_model, recorded, 1, logging=dict(save_rollouts=True))).train()
    for key, value in (("rollout.temperature", 0.7), ("rollout.top_p", 0.9), ("rollout.top_k", 5),
                       ("precision.generation_autocast_dtype", "bfloat16")):
        section, _, field = key.partition(".")
        with pytest.raises(ValueError, match=f"--resume cannot change {key} .* iterations 1..1 were recorded"):
            Trainer(small(tiny_model, recorded, 2, **{section: {field: value}}, logging=dict(save_rollouts=True)),
                    resume=True, report=lambda _: None)
    plain = tmp_path / "plain"
    Trainer(small(tiny_model, plain, 1)).train()
    said = []
    Trainer(small(tiny_model, plain, 2, rollout=dict(temperature=0.7)), resume=True, report=said.append).train()
    assert any("temperature" in line for line in said), said
    assert [r["step"] for r in read_metrics(plain)] == [1, 2]
