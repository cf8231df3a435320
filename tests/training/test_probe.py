"""The learner probe (probe_every / probe_prompts): it plays the current actor, not the lagged generator, never
changes what a run trains, resumes exactly, and is recorded in config.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from stppo_agent.models.loading import load_actor
from stppo_agent.models.tiny import word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import merged
from stppo_agent.training.probe import KEYS, LearnerProbe
from stppo_agent.training.trainer import Trainer
from tests.support.runs import TIMING, toy_config

IGNORED = TIMING | {"probe_seconds"}


def config(model: Path, out: Path, **overrides):
    values = dict(iterations=4, env_kwargs={"fixed_target": None},
                  rollout=dict(prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens_per_turn=3),
                  optimizer=dict(epochs=1, mini_batch_size=16, micro_batch_size=8, actor_lr=5e-2),
                  monitor=dict(on_collapse="none"), checkpoint=dict(every=1, keep=10))
    values = merged(values, overrides)
    return toy_config(model, out, "ppo", **values)


def without(records: list[dict], keys) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in keys} for r in records]


def final_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_actor(str(run / "checkpoints" / f"step-{step}" / "actor")).state_dict()


def test_a_run_with_probes_trains_exactly_as_one_without(tiny_model, tmp_path):
    Trainer(config(tiny_model, tmp_path / "plain"), report=lambda _: None).train()
    Trainer(config(tiny_model, tmp_path / "probed", monitor=dict(probe_every=1, probe_prompts=6)),
            report=lambda _: None).train()
    plain, probed = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "probed")
    assert all(set(KEYS) <= set(r) for r in probed) and not any(set(KEYS) & set(r) for r in plain)
    assert without(probed, IGNORED | set(KEYS)) == without(plain, IGNORED)
    a, b = final_weights(tmp_path / "plain", 4), final_weights(tmp_path / "probed", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["probe/policy_version"] for r in probed] == [1, 2, 3, 4]  # one optimizer step per iteration here
    recorded = yaml.safe_load((tmp_path / "probed" / "config.yaml").read_text())
    assert (recorded["monitor"]["probe_every"], recorded["monitor"]["probe_prompts"]) == (1, 6)


def test_probes_every_nth_iteration_and_reports_optimizer_steps(tiny_model, tmp_path):
    run = tmp_path / "run"
    Trainer(config(tiny_model, run, monitor=dict(probe_every=2), optimizer=dict(epochs=2, mini_batch_size=8)),
            report=lambda _: None).train()
    records = read_metrics(run)
    assert ["probe/reward" in r for r in records] == [False, True, False, True]
    # 16 trajectories in mini-batches of 8, two epochs: 4 optimizer steps an iteration
    assert [r["probe/policy_version"] for r in records if "probe/reward" in r] == [8, 16]


def test_under_staleness_the_probe_plays_the_learner_not_the_lagged_generator(tiny_model, tmp_path):
    run = tmp_path / "stale"
    settings = config(tiny_model, run, iterations=4, rollout=dict(staleness=2),
                      monitor=dict(probe_every=1, probe_prompts=16))
    trainer = Trainer(settings, report=lambda _: None)
    generators = {}
    measure = trainer.probe.measure

    def spy(model, iteration, version):
        generators[iteration] = {k: v.clone() for k, v in trainer.state.stale_policy.model.state_dict().items()}
        return measure(model, iteration, version)

    trainer.probe.measure = spy
    trainer.train()
    logged = {r["step"]: r for r in read_metrics(run)}
    tokenizer = word_tokenizer()
    for iteration in (3, 4):
        learner = load_actor(str(run / "checkpoints" / f"step-{iteration}" / "actor"))
        again = LearnerProbe(settings, tokenizer).measure(learner, iteration, iteration)
        assert {k: again[k] for k in KEYS} == {k: logged[iteration][k] for k in KEYS}
        lagged = load_actor(str(run / "checkpoints" / f"step-{iteration}" / "actor"))
        lagged.load_state_dict(generators[iteration])
        assert not all(torch.equal(lagged.state_dict()[k], learner.state_dict()[k]) for k in generators[iteration])
        other = LearnerProbe(settings, tokenizer).measure(lagged, iteration, iteration)
        assert other["probe/entropy"] != logged[iteration]["probe/entropy"]


def test_a_resumed_run_probes_and_trains_as_an_uninterrupted_one(tiny_model, tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    Trainer(config(tiny_model, whole, monitor=dict(probe_every=1), rollout=dict(staleness=1)),
            report=lambda _: None).train()
    Trainer(config(tiny_model, cut, iterations=2, monitor=dict(probe_every=1), rollout=dict(staleness=1)),
            report=lambda _: None).train()
    Trainer(config(tiny_model, cut, monitor=dict(probe_every=1), rollout=dict(staleness=1)), resume=True,
            report=lambda _: None).train()
    assert without(read_metrics(cut), IGNORED) == without(read_metrics(whole), IGNORED)


@pytest.mark.parametrize("field,value,message", [("probe_every", -1, "monitor.probe_every must be >= 0, got -1"),
                                                 ("probe_prompts", 0, "monitor.probe_prompts must be >= 1, got 0")])
def test_bad_probe_settings_are_refused_before_models_load(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        config(Path("/no/such/model"), tmp_path, monitor={field: value}).validate()
