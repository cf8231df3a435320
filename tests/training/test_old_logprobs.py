"""Where the PPO ratio's denominator comes from (``old_logprobs``): a forward
of the behaviour weights in the learner's precision, the sampler's own log-probs, or -- when the update is one
optimizer step on the whole batch by the weights that sampled it -- the update's own forward."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training import scoring
from stppo_agent.training import trainer as trainer_module
from stppo_agent.training.config import merged
from stppo_agent.training.log_probs import token_logprobs
from stppo_agent.training.scoring import old_logprobs_from_update
from stppo_agent.training.trainer import Trainer
from tests.support.runs import toy_config


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


# When an iteration's update is one optimizer step on the whole batch by the weights that sampled it, the PPO ratio's
# denominator comes from the update's own forward, detached, instead of a scoring forward
# (scoring.old_logprobs_from_update): every ratio exactly 1, the same update up to rounding, one actor forward fewer,
# and the sampler/learner mismatch statistics still measured.


SINGLE_STEP = dict(iterations=3, rollout=dict(prompts_per_iteration=4, samples_per_prompt=4),
                   optimizer=dict(mini_batch_size=16, micro_batch_size=8, epochs=1, actor_lr=5e-2),
                   logging=dict(step_diagnostics=True), monitor=dict(on_collapse="none"))


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
