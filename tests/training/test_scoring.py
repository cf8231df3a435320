"""``stppo_agent.training.scoring``: old and reference log-probs, values, advantages
whitened over the global batch only for an estimator that whitens, and the rollout correction's weights."""

from __future__ import annotations

import pytest
import torch

from stppo_agent.distributed import process_group
from stppo_agent.training.config import merged
from stppo_agent.training.scoring import score_batch
from stppo_agent.training.trainer import Trainer
from tests.support.runs import toy_config
from tests.support.training_parts import config, dataclasses_replace, make_batch, tiny_lm


def scoring_inputs(algo="ppo", reference=True, critic=True, **values) -> dict:
    """What score_batch takes: the config, tiny actor, critic, reference and lagged generator (other weights than
    the actor's), on the CPU, one process."""
    values = merged({"rollout": {"temperature": 0.7},
                     "optimizer": {"micro_batch_size": 2, "mini_batch_size": 4, "max_grad_norm": 1e6}}, values)
    cfg = config(algo=algo, **values)
    return dict(config=cfg, algo=cfg.algorithm_config(), actor=tiny_lm(0), generator=tiny_lm(5).eval(),
                reference=tiny_lm(6).eval() if reference else None,
                critic=tiny_lm(1, critic=True) if critic else None, device=torch.device("cpu"), world=1)


def expected_scores(t, batch, behaviour, sampler=None):
    """``behaviour``: the ratio's denominator; ``sampler`` (default: the same): the weights that sampled the batch,
    whose KL to the reference the reward's penalty is."""
    from stppo_agent.algorithms import estimate_advantages, kl_reward_penalty
    from stppo_agent.training.log_probs import critic_values, token_logprobs

    sampling, algo, reference, critic = t["config"].sampling(), t["algo"], t["reference"], t["critic"]
    with torch.no_grad():
        old = token_logprobs(behaviour.eval(), batch, sampling=sampling)[0]
        sampled = old if sampler is None else token_logprobs(sampler.eval(), batch, sampling=sampling)[0]
        ref = token_logprobs(reference, batch, sampling=sampling)[0] if reference is not None else None
        values = critic_values(critic.eval(), batch) if critic is not None else torch.zeros_like(old)
        penalty = kl_reward_penalty(sampled, ref, batch.loss_mask, algo) \
            if algo.kl_in_reward > 0 and ref is not None else None
        adv, ret = estimate_advantages(algo.advantage, rewards=batch.rewards, values=values,
                                       loss_mask=batch.loss_mask, group_ids=batch.group_ids, config=algo,
                                       kl_penalty=penalty, turn_ids=batch.turn_ids)
    return old, ref, values, adv, ret


@pytest.mark.parametrize("objective", ["coupled", "decoupled"])
def test_scoring_takes_old_logprobs_from_the_behaviour_policy(objective):
    from stppo_agent.training.scoring import score_batch

    t = scoring_inputs(algorithm={"kl_in_reward": 0.2}, rollout=dict(stale_objective=objective, staleness=1),
                       optimizer=dict(micro_batch_size=2))
    batch = make_batch()
    behaviour = t["generator"] if objective == "coupled" else t["actor"]
    old, ref, values, adv, ret = expected_scores(t, batch, behaviour, sampler=t["generator"])
    batch.old_logprobs = batch.ref_logprobs = batch.values = batch.advantages = batch.returns = None
    score_batch(batch, **t)
    mask = batch.loss_mask
    assert torch.allclose(batch.old_logprobs[mask], old[mask], atol=1e-5)
    assert torch.allclose(batch.ref_logprobs[mask], ref[mask], atol=1e-5)
    assert torch.allclose(batch.values[mask], values[mask], atol=1e-5)
    # the reward's KL is the sampling (lagged) policy's under both objectives; the behaviour weight of decoupled
    # goes to the loss as token_weights, not into the advantages
    assert torch.allclose(batch.advantages[mask], adv[mask], atol=1e-4)
    assert (batch.token_weights is None) == (objective == "coupled")
    assert torch.allclose(batch.returns[mask], ret[mask], atol=1e-4)
    assert batch.stats["advantage/mean"] == pytest.approx(float(adv[mask].mean()), abs=1e-5)
    assert batch.stats["advantage/std"] == pytest.approx(float(adv[mask].std()), rel=1e-4)
    sampled = expected_scores(t, batch, t["generator"])[0]  # kl_to_reference: the lagged policy's, both ways
    assert batch.stats["kl_to_reference"] == pytest.approx(float((sampled - ref)[mask].mean()), abs=1e-5)


def test_scoring_without_critic_or_reference():
    from stppo_agent.training.scoring import score_batch

    t = scoring_inputs("grpo", reference=False, critic=False, algorithm={"kl_loss_coef": 0.0, "kl_in_reward": 0.0},
                       rollout=dict(samples_per_prompt=2))
    batch = make_batch()
    batch.ref_logprobs = batch.values = None
    _, _, _, adv, _ = expected_scores(t, batch, t["generator"])
    score_batch(batch, **t)
    assert batch.ref_logprobs is None and batch.values is None and "kl_to_reference" not in batch.stats
    assert torch.allclose(batch.advantages, adv, atol=1e-5)


def test_scoring_whitens_over_the_global_batch_with_several_ranks(monkeypatch):
    import stppo_agent.training.scoring as scoring

    whitened = []
    monkeypatch.setattr(scoring.process_group, "distributed_whiten",
                        lambda x, mask: whitened.append(x.clone()) or x * 0 + 7.0)
    t = scoring_inputs(reference=False)
    t["world"] = 2
    batch = make_batch()
    scoring.score_batch(batch, **t)
    assert len(whitened) == 1 and (batch.advantages == 7.0).all()
    raw = dataclasses_replace(t["algo"], whiten_advantages=False)
    t["world"], t["algo"] = 1, raw
    again = make_batch()
    scoring.score_batch(again, **t)
    assert torch.allclose(whitened[0], again.advantages, atol=1e-5)  # the local estimate, not whitened locally


def test_scoring_hands_the_rollout_correction_weights_to_the_loss():
    from stppo_agent.training.scoring import score_batch

    t = scoring_inputs(reference=False, algorithm={"rollout_correction": "tis", "rollout_correction_level": "token"})
    batch = make_batch()
    batch.sample_logprobs = torch.full_like(batch.sample_logprobs, -2.0)
    plain = scoring_inputs(reference=False, algorithm={"rollout_correction": "none"})
    reference_batch = make_batch()
    reference_batch.sample_logprobs = batch.sample_logprobs.clone()
    score_batch(batch, **t)
    score_batch(reference_batch, **plain)
    assert "rollout_logprob_diff" in batch.stats
    mask = batch.loss_mask
    assert torch.allclose(batch.advantages[mask], reference_batch.advantages[mask], atol=1e-6)  # not folded in
    expected = torch.exp(batch.old_logprobs + 2.0).clamp(max=2.0)
    assert torch.allclose(batch.token_weights[mask], expected[mask], atol=1e-6) and not batch.token_weights[~mask].any()
    assert reference_batch.token_weights is None  # no correction: every weight 1


# With several processes the trainer whitens advantages over the global batch -- but only those of an estimator that
# whitens at all: GRPO's and RLOO's are normalised within their groups and never whitened, so a run under torchrun
# must leave them as one process leaves them.


@pytest.mark.parametrize("algo, whitened", [("ppo", True), ("grpo", False), ("so_grpo", False)])
def test_only_an_estimator_that_whitens_is_whitened_over_the_global_batch(tiny_model, tmp_path, monkeypatch, algo,
                                                                          whitened):
    config = toy_config(tiny_model, tmp_path, algo, iterations=1,
                        rollout=dict(prompts_per_iteration=4, samples_per_prompt=4),
                        optimizer=dict(mini_batch_size=8, micro_batch_size=8))
    trainer = Trainer(config, report=lambda _: None)
    assert trainer.algo.whiten_advantages  # the presets leave it on: the estimator decides
    batch = trainer.rollout()
    calls = []
    monkeypatch.setattr(process_group, "distributed_whiten", lambda values, mask: calls.append(1) or values)
    state = trainer.state
    score_batch(batch, config=config, algo=trainer.algo, actor=state.actor, generator=state.actor,
                reference=state.reference, critic=state.critic, device=trainer.device, world=2)
    assert bool(calls) == whitened
