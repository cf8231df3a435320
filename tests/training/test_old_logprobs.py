"""old_logprobs: recompute (the ratio's denominator from a forward of the behaviour weights in the learner's
precision, as before) or sampler (the log-probs the sampler computed while generating: no extra forward, and a
sampler/learner precision gap reaches the ratio and the clip)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import merged
from stppo_agent.training.log_probs import token_logprobs
from stppo_agent.training.trainer import Trainer

from .test_trainer import toy_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


def config(model: Path, out: Path, **overrides):
    values = dict(iterations=1, rollout=dict(prompts_per_iteration=4, samples_per_prompt=4, temperature=1.0),
                  optimizer=dict(epochs=1, mini_batch_size=8, micro_batch_size=8), logging=dict(step_diagnostics=True),
                  monitor=dict(on_collapse="none"))
    values = merged(values, overrides)
    return toy_config(model, out, "ppo", **values)


def first_step(run: Path) -> dict:
    return json.loads((run / "steps.jsonl").read_text().splitlines()[0])


def distance_from_one(step: dict) -> float:
    return max(step["ratio_max"] - 1, 1 - step["ratio_min"])


def test_a_bfloat16_sampler_moves_the_first_ratios_only_with_the_samplers_log_probs(tiny_model, tmp_path):
    runs = {"recompute": {}, "sampler": {"rollout": {"old_logprobs": "sampler"}},
            "recompute_bf16": {"precision": {"generation_autocast_dtype": "bfloat16"}},
            "sampler_bf16": {"rollout": {"old_logprobs": "sampler"},
                             "precision": {"generation_autocast_dtype": "bfloat16"}}}
    for name, overrides in runs.items():
        Trainer(config(tiny_model, tmp_path / name, **overrides), report=lambda _: None).train()
    first = {name: first_step(tmp_path / name) for name in runs}
    # recomputed in float32 by the learner: 1 up to rounding, whatever precision the sampler ran in
    assert distance_from_one(first["recompute"]) < 1e-6
    assert distance_from_one(first["recompute_bf16"]) < 1e-6
    # the sampler's own float32 log-probs (KV cache, other batch shapes): 1 up to rounding too
    assert distance_from_one(first["sampler"]) < 1e-5
    # the bfloat16 sampler's: the precision gap is in the ratio, measurably (6e-4 on this model), and it is a gap
    # of rounding, not another policy
    assert 1e-4 < distance_from_one(first["sampler_bf16"]) < 0.05
    assert [first[name]["on_policy"] for name in runs] == [True, True, True, False]
    metrics = {name: read_metrics(tmp_path / name)[-1] for name in runs}
    assert metrics["sampler_bf16"]["offpolicy/steps"] == 2.0 and metrics["recompute"]["offpolicy/steps"] == 1.0
    # no second measurement of the gap with the sampler's log-probs as the old ones
    assert "rollout_logprob_diff" not in metrics["sampler_bf16"]
    assert metrics["recompute_bf16"]["rollout_logprob_diff"] > 1e-4


@pytest.mark.parametrize(("old_logprobs", "forwards"), [("recompute", True), ("sampler", False)])
def test_the_sampler_mode_skips_the_old_log_prob_forward(tiny_model, tmp_path, old_logprobs, forwards):
    trainer = Trainer(config(tiny_model, tmp_path, rollout=dict(old_logprobs=old_logprobs)), report=lambda _: None)
    batch = trainer.rollout()
    calls = []
    handle = trainer.state.actor.register_forward_hook(lambda *_: calls.append(1))
    trainer.score(batch)
    handle.remove()
    assert bool(calls) is forwards
    if old_logprobs == "sampler":
        mask = batch.loss_mask
        assert torch.equal(batch.old_logprobs[mask], batch.sample_logprobs[mask])


def test_under_staleness_the_sampler_log_probs_are_the_lagged_samplers(tiny_model, tmp_path):
    trainer = Trainer(config(tiny_model, tmp_path, iterations=2, rollout=dict(staleness=1, old_logprobs="sampler"),
                             optimizer=dict(actor_lr=5e-2)), report=lambda _: None)
    trainer.train()
    batch = trainer.rollout()
    trainer.score(batch)
    sampling, mask = trainer.config.sampling(), batch.loss_mask
    with torch.no_grad():
        lagged = token_logprobs(trainer.state.stale_policy.model, batch, sampling=sampling)[0]
        current = token_logprobs(trainer.state.actor, batch, sampling=sampling)[0]
    assert torch.equal(batch.old_logprobs[mask], batch.sample_logprobs[mask])
    assert (batch.old_logprobs[mask] - lagged[mask]).abs().max() < 1e-4  # the lagged weights sampled it
    assert (batch.old_logprobs[mask] - current[mask]).abs().max() > 1e-3  # not the actor's


def test_what_the_sampler_mode_combines_with(tiny_model, tmp_path):
    sampler = config(tiny_model, tmp_path, rollout=dict(old_logprobs="sampler"),
                     precision=dict(generation_autocast_dtype="bfloat16"))
    assert sampler.algorithm_config().rollout_correction == "none"  # auto: the ratio itself holds the gap
    assert "old_logprobs: sampler" in sampler.to_yaml(resolved=sampler.algorithm_config())
    with pytest.raises(ValueError, match=r"^rollout.old_logprobs=sampler puts the sampler's log-probs in the ratio, so "
                                         r"there is no gap left for rollout_correction=tis to weigh"):
        config(tiny_model, tmp_path, algorithm={"rollout_correction": "tis"},
               rollout=dict(old_logprobs="sampler")).validate()
    with pytest.raises(ValueError, match=r"^rollout.stale_objective=decoupled takes the ratio against the current "
                                         r"weights"):
        config(tiny_model, tmp_path, rollout=dict(old_logprobs="sampler", staleness=2,
                                                  stale_objective="decoupled")).validate()
    config(tiny_model, tmp_path, rollout=dict(old_logprobs="sampler",
                                              stale_objective="decoupled")).validate()  # no lag: no-op
    config(tiny_model, tmp_path, rollout=dict(old_logprobs="sampler", staleness=2)).validate()  # coupled: fine
    with pytest.raises(ValueError, match=r"^rollout.old_logprobs must be recompute or sampler, got 'vllm'$"):
        config(tiny_model, tmp_path, rollout=dict(old_logprobs="vllm")).validate()
