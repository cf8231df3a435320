"""``stppo_agent.training.stale_policy``: rollouts sampled by the policy of K
iterations earlier, the lag in checkpoints (resume, kill -9), replay, and K = 0 unchanged."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from stppo_agent.models.loading import load_actor
from stppo_agent.models.precision import autocast_forward, independent_copy
from stppo_agent.models.tiny import toy_train_command
from stppo_agent.runs.checkpoint import load_trainer_state
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import TrainConfig, merged
from stppo_agent.training.log_probs import token_logprobs
from stppo_agent.training.replay import replay
from stppo_agent.training.trainer import Trainer
from tests.support.paths import REPO
from tests.support.processes import kill_9_once_written
from tests.support.runs import TIMING, toy_config
from tests.support.training_parts import tiny_lm


def stale_config(model: Path, out: Path, staleness: int, **overrides) -> TrainConfig:
    values = dict(iterations=5, rollout=dict(prompts_per_iteration=4, samples_per_prompt=4, staleness=staleness),
                  optimizer=dict(mini_batch_size=8, micro_batch_size=4, epochs=1, actor_lr=2e-2),
                  monitor=dict(on_collapse="none"))
    values = merged(values, overrides)
    return toy_config(model, out, "ppo", **values)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_independent_copy_computes_with_its_own_weights_under_autocast(tiny_model):
    original = autocast_forward(load_actor(str(tiny_model)), "bfloat16")
    clone = independent_copy(original, "bfloat16")
    ids = torch.tensor([[1, 2, 3, 4]])
    before = original(input_ids=ids).logits
    assert torch.equal(clone(input_ids=ids).logits, before)
    with torch.no_grad():
        for parameter in clone.parameters():
            parameter.mul_(0.5)
    # a plain deepcopy's forward closes over the original's: it would still return `before` here
    assert not torch.equal(clone(input_ids=ids).logits, before)
    assert torch.equal(original(input_ids=ids).logits, before)
    assert clone(input_ids=ids).logits.dtype == torch.float32  # the head still runs in float32


@pytest.mark.parametrize("staleness", [1, 2])
def test_iteration_i_samples_with_the_weights_after_i_minus_k_updates(tiny_model, tmp_path, staleness):
    seen = []  # per iteration, at rollout time: (the generating weights, the actor's weights)
    trainer = Trainer(stale_config(tiny_model, tmp_path, staleness), report=lambda _: None)
    trainer.batch_hook = lambda batch: seen.append((weights(trainer.backend.model), weights(trainer.state.actor)))
    trainer.train()
    assert len(seen) == 5
    for i, (generator, _) in enumerate(seen):
        assert same(generator, seen[max(0, i - staleness)][1]), i
        if i >= 1:
            assert not same(generator, seen[i][1]), i  # the actor has moved on: the data is stale
    assert [r["staleness"] for r in read_metrics(tmp_path)] == [min(i, staleness) for i in range(5)]


def test_coupled_ratios_are_taken_against_the_lagged_policy_decoupled_against_the_current(tiny_model, tmp_path):
    for objective, expected in (("coupled", "stale"), ("decoupled", "actor")):
        trainer = Trainer(stale_config(tiny_model, tmp_path / objective, 1, iterations=2,
                                       rollout=dict(stale_objective=objective)),
                          report=lambda _: None)
        trainer.train()
        batch = trainer.rollout()
        trainer.score(batch)
        sampling = trainer.config.sampling()
        with torch.no_grad():
            stale = token_logprobs(trainer.state.stale_policy.model, batch, sampling=sampling)[0]
            current = token_logprobs(trainer.state.actor, batch, sampling=sampling)[0]
        mask = batch.loss_mask
        assert (stale[mask] - current[mask]).abs().max() > 1e-3  # a lag of one update at lr 2e-2 shows
        chosen, other = (stale, current) if expected == "stale" else (current, stale)
        # scored in micro-batches, trimmed per micro-batch: equal up to float rounding, far from the other policy
        assert torch.allclose(batch.old_logprobs[mask], chosen[mask], atol=1e-5), objective
        assert not torch.allclose(batch.old_logprobs[mask], other[mask], atol=1e-5), objective
        if objective == "decoupled":  # the lag enters as the capped behaviour weight pi_prox / pi_behav
            assert trainer.algo.rollout_correction == "mis"
            assert batch.stats["rollout_correction/kl"] > 0
            assert "rollout_correction/masked_frac" in batch.stats


def test_staleness_zero_is_the_trainer_of_before(tiny_model, tmp_path):
    trainer = Trainer(stale_config(tiny_model, tmp_path, 0, iterations=2, checkpoint=dict(every=1)),
                      report=lambda _: None)
    assert trainer.state.stale_policy.model is trainer.state.actor and trainer.backend.model is trainer.state.actor
    trainer.train()
    assert "staleness" not in read_metrics(tmp_path)[-1]
    tensors, _ = load_trainer_state(tmp_path / "checkpoints" / "step-2")
    assert "stale_policy" not in tensors


def test_bad_settings_are_refused(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="rollout.staleness must be >= 0"):
        stale_config(tiny_model, tmp_path, -1).validate()
    with pytest.raises(ValueError, match="stale_objective must be coupled or decoupled"):
        stale_config(tiny_model, tmp_path, 1, rollout=dict(stale_objective="async")).validate()
    with pytest.raises(ValueError, match="needs distributed.strategy=ddp and rollout.backend=hf"):
        stale_config(tiny_model, tmp_path, 1, distributed=dict(strategy="fsdp2")).validate()
    with pytest.raises(ValueError, match="set algorithm.rollout_correction to mis, tis or auto"):
        stale_config(tiny_model, tmp_path, 1, algorithm={"rollout_correction": "none"},
                     rollout=dict(stale_objective="decoupled")).validate()
    stale_config(tiny_model, tmp_path, 0, algorithm={"rollout_correction": "none"},
                 rollout=dict(stale_objective="decoupled")) \
        .validate()  # without staleness the objective has nothing to decouple


def test_a_resume_continues_the_lag_and_refuses_another_k(tiny_model, tmp_path):
    straight = tmp_path / "straight"
    Trainer(stale_config(tiny_model, straight, 2), report=lambda _: None).train()
    stopped = tmp_path / "stopped"
    Trainer(stale_config(tiny_model, stopped, 2, iterations=3, checkpoint=dict(every=1)), report=lambda _: None).train()
    tensors, _ = load_trainer_state(stopped / "checkpoints" / "step-3")
    # two queued weights: the older stored, the newer the checkpoint's own actor
    assert len(tensors["stale_policy"]["pending"]) == 1 and tensors["stale_policy"]["pending_from_actor"]
    with pytest.raises(ValueError, match="rollout.staleness"):
        Trainer(stale_config(tiny_model, stopped, 1), resume=True, report=lambda _: None)
    Trainer(stale_config(tiny_model, stopped, 2), resume=True, report=lambda _: None).train()
    a, b = read_metrics(straight), read_metrics(stopped)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        for key in sorted(set(x) - TIMING):
            assert x[key] == y[key], (x["step"], key)


def test_kill_9_then_resume_with_staleness_matches_an_uninterrupted_run(tiny_model, tmp_path):
    iterations, extra = 8, ("rollout.staleness=2",)
    interrupted, reference = tmp_path / "interrupted", tmp_path / "reference"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(toy_train_command(tiny_model, interrupted, iterations, extra=extra), env=env, cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    kill_9_once_written(process, interrupted / "checkpoints" / "step-3")
    assert max(int(p.name.split("-")[1]) for p in (interrupted / "checkpoints").glob("step-*")) < iterations
    subprocess.run(toy_train_command(tiny_model, interrupted, iterations, resume=True, extra=extra), env=env,
                   cwd=REPO, check=True, capture_output=True)
    subprocess.run(toy_train_command(tiny_model, reference, iterations, extra=extra), env=env, cwd=REPO, check=True,
                   capture_output=True)
    final = f"checkpoints/step-{iterations}"
    resumed, uninterrupted = load_trainer_state(interrupted / final)[0], load_trainer_state(reference / final)[0]
    assert len(resumed["stale_policy"]["pending"]) == len(uninterrupted["stale_policy"]["pending"]) == 1
    for a, b in zip([resumed["stale_policy"]["model"], *resumed["stale_policy"]["pending"]],
                    [uninterrupted["stale_policy"]["model"], *uninterrupted["stale_policy"]["pending"]]):
        assert same(a, b)
    assert same(load_actor(str(interrupted / final / "actor")).state_dict(),
                load_actor(str(reference / final / "actor")).state_dict())
    assert [r["staleness"] for r in read_metrics(interrupted)] == [0, 1] + [2] * (iterations - 2)
    assert [r["reward"] for r in read_metrics(interrupted)] == [r["reward"] for r in read_metrics(reference)]


def test_a_stale_run_replays_exactly(tiny_model, tmp_path):
    run = tmp_path / "run"
    Trainer(stale_config(tiny_model, run, 1, iterations=3, logging=dict(save_rollouts=True)),
            report=lambda _: None).train()
    replay(run, None, str(tmp_path / "again"), report=lambda _: None)
    original, again = read_metrics(run), read_metrics(tmp_path / "again")
    assert len(original) == len(again) == 3
    for a, b in zip(original, again):
        for key in sorted(set(a) - TIMING):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


# -- stale_policy ---------------------------------------------------------------------------------------------

def test_staleness_zero_generates_with_the_actor_itself():
    from stppo_agent.training.stale_policy import StalePolicy

    actor = torch.nn.Linear(2, 2)
    policy = StalePolicy(actor, 0)
    assert policy.model is actor and policy.lag == 0 and policy.state(actor) == {}
    assert actor.training and actor.weight.requires_grad
    policy.advance(actor)
    assert policy.lag == 0 and not policy.pending
    policy.load(None, actor)  # nothing to restore
    with pytest.raises(ValueError, match=r"^rollout.staleness must be >= 0, got -1$"):
        StalePolicy(actor, -1)


def test_iteration_i_generates_with_the_weights_after_i_minus_k_updates():
    from stppo_agent.training.stale_policy import StalePolicy

    actor = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        actor.weight.fill_(0.0)
    policy = StalePolicy(actor, 2)
    assert policy.model is not actor and not policy.model.training
    assert not any(p.requires_grad for p in policy.model.parameters()) and actor.weight.requires_grad
    assert policy.state(actor)["pending"] == [] and float(policy.state(actor)["model"]["weight"]) == 0.0
    assert not policy.state(actor)["pending_from_actor"]  # nothing queued yet
    generating = []
    for update in range(1, 6):  # iteration update-1 plays, then the actor takes its update-th step
        generating.append(float(policy.model.weight))
        with torch.no_grad():
            actor.weight.fill_(float(update))
        policy.advance(actor)
        assert policy.lag == min(2, update)
    assert generating == [0.0, 0.0, 0.0, 1.0, 2.0]  # max(0, i - 2) updates
    state = policy.state(actor)
    # the newest queued weights (5.0) are the actor's own: the checkpoint's actor restores them
    assert float(state["model"]["weight"]) == 3.0 and [float(s["weight"]) for s in state["pending"]] == [4.0]
    assert state["pending_from_actor"] and state["aliases"] == {}
    with torch.no_grad():
        policy.model.weight.fill_(-1.0)
    assert float(state["model"]["weight"]) == 3.0  # a copy, not the live tensor
    fresh = StalePolicy(actor, 2)
    fresh.load(state, actor)
    assert float(fresh.model.weight) == 3.0 and fresh.lag == 2
    assert [float(s["weight"]) for s in fresh.pending] == [4.0, 5.0]
    with torch.no_grad():
        actor.weight.fill_(6.0)  # another update: the queued actor weights were a copy too
    assert float(fresh.pending[-1]["weight"]) == 5.0
    other = StalePolicy(actor, 2)
    other.load({**state, "pending_from_actor": False}, actor)  # a queue stored whole (older checkpoints)
    assert [float(s["weight"]) for s in other.pending] == [4.0]
    with pytest.raises(ValueError, match=r"^the checkpoint holds no lagged policy, but rollout.staleness is 2"):
        fresh.load({}, actor)


def test_the_lagged_copy_keeps_the_autocast_of_the_run():
    from stppo_agent.models.precision import autocast_forward
    from stppo_agent.training.stale_policy import StalePolicy

    actor = autocast_forward(tiny_lm(), "bfloat16")
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        want = actor(input_ids=ids).logits
        got = StalePolicy(actor, 1, "bfloat16").model(input_ids=ids).logits
        plain = StalePolicy(actor, 1, None).model(input_ids=ids).logits
    assert torch.equal(got, want) and not torch.equal(plain, want)
