"""``stppo_agent.runs.resume_settings``: what ``--resume`` may change, what it
refuses, and the learning rate across rollbacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stppo_agent.cli import main
from stppo_agent.runs import resume_settings
from stppo_agent.runs.checkpoint import load_trainer_state
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.runs.resume_settings import check
from stppo_agent.training.config import merged
from stppo_agent.training.trainer import Trainer
from tests.support.runs import toy_config


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


# -- resume_settings -----------------------------------------------------------------------------------------------
def test_resume_settings_flatten_opens_every_mapping_as_set_spells_its_keys():
    config = {"algorithm": {"clip_high": 0.2}, "env_kwargs": {"split": "dev"},
              "monitor": {"thresholds": {"a": 1}, "z": 6.0}, "seed": 3}
    assert resume_settings.flatten(config) == {"algorithm.clip_high": 0.2, "env_kwargs.split": "dev",
                                               "monitor.thresholds.a": 1, "monitor.z": 6.0, "seed": 3}
    assert resume_settings.flatten({"algorithm": "ppo"}) == {"algorithm": "ppo"}


def test_resume_settings_changes_in_order_with_numbers_compared_by_value():
    previous = {"seed": 1, "actor_lr": 1, "gone": 5, "output_dir": "a", "flag": True, "xs": [1, 2],
                "algorithm": {"clip_high": 0.2, "old": 1}}
    current = {"actor_lr": 1.0, "seed": 1, "flag": 1, "xs": (1.0, 2.0), "output_dir": "b", "new": None,
               "algorithm": {"clip_high": 0.3}, "ys": [1]}
    assert resume_settings.changes(previous, current) == [
        ("algorithm.clip_high", 0.2, 0.3), ("ys", None, [1]), ("gone", 5, None),
        ("algorithm.old", 1, None)]
    assert resume_settings.changes({"xs": [1, 2]}, {"xs": [1]}) == [("xs", [1, 2], [1])]
    assert resume_settings.changes({"xs": [1, 2]}, {"xs": [1, 3]}) == [("xs", [1, 2], [1, 3])]
    assert resume_settings.changes({"a": 1}, {"a": False}) == [("a", 1, False)]
    assert resume_settings.changes({"a": 0}, {"a": False}) == []  # bools compare as Python does
    assert resume_settings.changes({"a": 1.5}, {"a": 3 / 2}) == [] and resume_settings.changes({"a": 2}, {"a": 2.5})
    assert resume_settings.changes({"a": [[1]]}, {"a": [[1.0]]}) == []
    assert resume_settings.changes({"a": "1"}, {"a": 1}) == [("a", "1", 1)]
    assert resume_settings.describe([("seed", 1, 2), ("model", None, "m")]) == "seed 1 -> 2, model unset -> m"
    assert resume_settings.describe([]) == ""


FIXED_REASONS = {
    "model": "the reference policy (KL) and the recorded initial weights are this model; the checkpoint's actor was "
             "trained from it (a moved copy of the same weights is accepted: checkpoints record their sha256, "
             "those written before that cannot tell)",
    "critic_model": "the checkpoint's critic was trained from it",
    "algo": "a run trains one algorithm; to apply another rule to the same start, replay recorded rollouts or start a "
            "new run from the checkpoint's actor",
    "algorithm.use_critic": "the checkpoint holds (or lacks) a critic and its optimizer state",
    "seed": "the random streams and the prompt order continue from the checkpoint; a new seed would make one run "
            "of two seeds",
    "env": "the checkpoint's prompt position indexes these envs' examples",
    "precision.dtype": "the weights and optimizer state are in this precision; a run, its resume and its replays "
                       "share it",
    "precision.autocast_dtype": "a run, its resume and its replays share the precision of their forward passes",
    "rollout.staleness": "the checkpoint holds the lagged weights of exactly this many iterations",
}
TAIL = (". Start a new run in another --output-dir instead (--model RUN/checkpoints/step-N/actor starts it from "
        "these weights)")


def test_resume_settings_check_refuses_what_the_checkpoint_is_tied_to_with_one_line():
    assert resume_settings.FIXED == FIXED_REASONS
    for key, reason in FIXED_REASONS.items():
        previous, current = resume_settings.flatten({key: "a"}), {key: None}
        with pytest.raises(ValueError) as caught:
            resume_settings.check(previous, current, 3)
        assert str(caught.value) == f"--resume cannot change {key} (a -> unset): {reason}{TAIL}"
    for name in ("dataset", "split", "limit", "shuffle_seed", "benchmark", "family"):
        with pytest.raises(ValueError) as caught:
            resume_settings.check({"env_kwargs": {name: 1}}, {"env_kwargs": {name: 2}}, 0)
        assert str(caught.value) == (f"--resume cannot change env_kwargs.{name} (1 -> 2): the checkpoint's prompt "
                                     f"position indexes the examples this selects{TAIL}")
    allowed = resume_settings.check({"env_kwargs": {"retriever": "bm25"}, "actor_lr": 1e-5, "output_dir": "a",
                                     "dataset": 1},
                                    {"env_kwargs": {"retriever": "dense"}, "actor_lr": 2e-5, "output_dir": "b",
                                     "dataset": 2}, 5)
    assert allowed == [("env_kwargs.retriever", "bm25", "dense"), ("actor_lr", 1e-5, 2e-5), ("dataset", 1, 2)]
    # the whole inner name is compared: a dotted env kwarg is not the dataset
    assert len(resume_settings.check({"env_kwargs": {"dataset.x": 1, "a.dataset": 1}},
                                     {"env_kwargs": {"dataset.x": 2, "a.dataset": 2}}, 3)) == 2
    first = {"seed": 1, "model": "a"}
    with pytest.raises(ValueError, match=r"^--resume cannot change seed \(1 -> 2\)"):  # the first in order
        resume_settings.check(first, {"seed": 2, "model": "b"}, 1)


def test_resume_settings_turning_recording_on_is_refused_only_after_the_first_iteration():
    off, on = {"logging": {"save_rollouts": False}}, {"logging": {"save_rollouts": True}}
    with pytest.raises(ValueError) as caught:
        resume_settings.check(off, on, 4)
    assert str(caught.value) == ("--resume cannot change logging.save_rollouts (False -> True): the recording would "
                                 "lack the initial weights and iterations 1..4, so stppo replay could not use it"
                                 + TAIL)
    with pytest.raises(ValueError, match=r"logging.save_rollouts \(unset -> True\).*iterations 1\.\.1,"):
        resume_settings.check({}, on, 1)
    assert resume_settings.check(off, on, 0) == [("logging.save_rollouts", False, True)]
    assert resume_settings.check(on, off, 4) == [("logging.save_rollouts", True, False)]
    assert resume_settings.check({"save_tokens": False}, {"save_tokens": True}, 4) == [("save_tokens", False, True)]


RECORDING = {"logging": {"save_rollouts": True}}


def test_a_recording_run_refuses_a_new_temperature_naming_the_old_one():
    with pytest.raises(ValueError) as info:
        check({**RECORDING, "rollout": {"temperature": 1.0}}, {**RECORDING, "rollout": {"temperature": 0.7}}, 3)
    assert str(info.value) == (
        "--resume cannot change rollout.temperature (1.0 -> 0.7): iterations 1..3 were recorded sampled with "
        "rollout.temperature=1.0, and stppo replay takes one setting for every recorded iteration. Start a new run in "
        "another --output-dir instead (--model RUN/checkpoints/step-N/actor starts it from these weights)")


def test_an_unset_old_setting_is_shown_as_unset():
    with pytest.raises(ValueError, match=r"recorded sampled with precision.generation_autocast_dtype=unset, and"):
        check(RECORDING, {**RECORDING, "precision": {"generation_autocast_dtype": "bfloat16"}}, 1)


def test_at_iteration_zero_nothing_was_recorded_so_sampling_may_change():
    assert check({**RECORDING, "rollout": {"top_k": 0}}, {**RECORDING, "rollout": {"top_k": 5}}, 0) == \
        [("rollout.top_k", 0, 5)]


def test_a_run_that_does_not_record_may_change_its_sampling():
    plain = {"logging": {"save_rollouts": False}}
    assert check({**plain, "rollout": {"top_p": 1.0}}, {**plain, "rollout": {"top_p": 0.9}}, 4) == \
        [("rollout.top_p", 1.0, 0.9)]
