"""When an iteration's update is one optimizer step on the whole batch by the weights that sampled it, the PPO
ratio's denominator comes from the update's own forward, detached, instead of a scoring forward
(scoring.old_logprobs_from_update): every ratio exactly 1, the same update up to rounding, one actor forward
fewer, and the sampler/learner mismatch statistics still measured."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training import scoring
from stppo_agent.training import trainer as trainer_module
from stppo_agent.training.config import merged
from stppo_agent.training.scoring import old_logprobs_from_update
from stppo_agent.training.trainer import Trainer

from .test_trainer import toy_config

SINGLE_STEP = dict(iterations=3, rollout=dict(prompts_per_iteration=4, samples_per_prompt=4),
                   optimizer=dict(mini_batch_size=16, micro_batch_size=8, epochs=1, actor_lr=5e-2),
                   logging=dict(step_diagnostics=True), monitor=dict(on_collapse="none"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


def run(model: Path, out: Path, algo: str, monkeypatch, shortcut: bool, **overrides) -> list[str]:
    """Train; returns which models scoring ran a forward of ("actor" for log-probs, "critic" for values)."""
    forwards: list[str] = []
    original = scoring.batched_no_grad

    def counted(fn, model, batch, micro):
        forwards.append("critic" if fn is scoring.critic_values else "actor")
        return original(fn, model, batch, micro)

    with monkeypatch.context() as patch:
        patch.setattr(scoring, "batched_no_grad", counted)
        if not shortcut:
            patch.setattr(trainer_module, "old_logprobs_from_update", lambda *args, **kwargs: False)
        Trainer(toy_config(model, out, algo, **merged(SINGLE_STEP, overrides)), report=lambda _: None).train()
    return forwards


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_one_step_per_batch_takes_the_denominator_from_the_update_and_matches_a_scoring_forward(
        tiny_model, tmp_path, monkeypatch, algo):
    fast = run(tiny_model, tmp_path / "fast", algo, monkeypatch, shortcut=True)
    slow = run(tiny_model, tmp_path / "slow", algo, monkeypatch, shortcut=False)
    critic = ["critic"] if algo == "ppo" else []
    assert fast == critic * 3 and slow == (["actor"] + critic) * 3  # one actor forward per iteration fewer
    steps = [json.loads(line) for line in (tmp_path / "fast" / "steps.jsonl").read_text().splitlines()]
    assert [(s["ratio_max"], s["ratio_min"]) for s in steps] == [(1.0, 1.0)] * 3  # the same forward: exactly 1
    fast_metrics, slow_metrics = read_metrics(tmp_path / "fast"), read_metrics(tmp_path / "slow")
    for mine, theirs in zip(fast_metrics, slow_metrics, strict=True):
        assert mine["reward"] == theirs["reward"]
        for key in ("pg_loss", "grad_norm", "entropy", "rollout_logprob_diff", "rollout_correction/weight_max"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
        assert mine["clip_frac"] == theirs["clip_frac"] == 0.0
    assert fast_metrics[0]["rollout_logprob_diff"] < 1e-5  # sampler and learner in float32: the same model
    weights = [load_file(tmp_path / name / "checkpoints" / "step-3" / "actor" / "model.safetensors")
               for name in ("fast", "slow")]
    for name, tensor in weights[0].items():
        torch.testing.assert_close(tensor, weights[1][name], rtol=1e-4, atol=1e-6)


def test_several_steps_per_batch_still_score_before_the_update(tiny_model, tmp_path, monkeypatch):
    forwards = run(tiny_model, tmp_path, "grpo", monkeypatch, shortcut=True, iterations=1,
                   optimizer=dict(mini_batch_size=8))
    assert forwards == ["actor"]  # the second mini-batch's denominator is the weights before the first step


def _decides(**changes) -> bool:
    config = toy_config(Path("m"), Path("o"), "grpo", **merged(SINGLE_STEP, changes.pop("config", {})))
    algo = config.algorithm_config()
    if "algo" in changes:
        algo = dataclasses.replace(algo, **changes.pop("algo"))
    keywords = dict(batch_size=16, lag=0, world=1, reference=None)
    return old_logprobs_from_update(config, algo, **{**keywords, **changes})


def test_the_denominator_comes_from_the_update_only_when_nothing_needs_it_before():
    assert _decides()
    assert not _decides(batch_size=17)  # more rows than one mini-batch: two steps
    assert not _decides(config={"optimizer": {"epochs": 2}})
    assert not _decides(lag=1)  # a lagged generator sampled the batch
    assert not _decides(world=2)
    assert not _decides(reference=torch.nn.Linear(1, 1))  # the KL columns read the denominator before the update
    assert not _decides(algo={"rollout_correction": "tis"})  # its weights are computed from it before the update
    assert not _decides(config={"rollout": {"old_logprobs": "sampler"}})  # no forward to save


def test_the_update_refuses_a_missing_denominator_when_it_takes_several_steps(tiny_model, tmp_path):
    config = toy_config(tiny_model, tmp_path, "grpo",
                        **merged(SINGLE_STEP, {"iterations": 1, "optimizer": {"mini_batch_size": 8}}))
    trainer = Trainer(config, report=lambda _: None)
    batch = trainer.rollout()
    scoring.score_batch(batch, config=config, algo=trainer.algo, actor=trainer.state.actor,
                        generator=trainer.state.actor, reference=None, critic=None, device=trainer.device,
                        old_from_update=True)
    assert batch.old_logprobs is None
    with pytest.raises(ValueError, match="only when it is one optimizer step in one process"):
        trainer.update(batch)
