"""Scoring a rollout batch before the update: the log-probs the PPO ratios start from, the reference's for the KL
terms, the critic's values, and the advantages (whitened over the global batch when there are several ranks)."""

from __future__ import annotations

import dataclasses

import torch

from stppo_agent.algorithms import estimate_advantages, kl_reward_penalty, rollout_correction_weights
from stppo_agent.distributed import process_group
from stppo_agent.rollouts.batch import RolloutBatch
from stppo_agent.training.log_probs import batched_no_grad, critic_values, token_logprobs


@torch.no_grad()
def score_batch(trainer, batch: RolloutBatch) -> None:
    """Behaviour (pre-update) and reference log-probs, values, then advantages and returns, set on ``batch``;
    the rollout-correction weights fold into the advantages."""
    micro, sampling = trainer.config.micro_batch_size, trainer.config.sampling()

    def sampled_logprobs(model, micro_batch):  # under the distribution the rollout sampled from (as verl)
        return token_logprobs(model, micro_batch, sampling=sampling)

    # Under FSDP2 each model is gathered once for all its micro-batches (one all-gather instead of one per
    # micro-batch), and one model at a time, so at most one full copy of weights is held.
    # The PPO ratio's denominator: the policy that sampled the batch (the actor itself unless rollout_staleness lags
    # the generator), or for decoupled PPO the proximal policy, the actor before this update; with
    # old_logprobs=sampler, what the sampler computed while generating, in its own precision (no forward here).
    sampler_logprobs = trainer.config.old_logprobs == "sampler"
    if sampler_logprobs:
        batch.old_logprobs = batch.sample_logprobs.to(trainer.device, torch.float32, copy=True)
    else:
        behaviour = trainer.stale_policy.model if trainer.config.stale_objective == "coupled" else trainer.actor
        with process_group.gathered(behaviour):
            batch.old_logprobs = batched_no_grad(sampled_logprobs, behaviour, batch, micro)
    if trainer.reference is not None:
        with process_group.gathered(trainer.reference):
            batch.ref_logprobs = batched_no_grad(sampled_logprobs, trainer.reference, batch, micro)
    if trainer.critic is not None:
        with process_group.gathered(trainer.critic):
            batch.values = batched_no_grad(critic_values, trainer.critic, batch, micro)
    kl_penalty = None
    if trainer.algo.kl_in_reward > 0 and batch.ref_logprobs is not None:
        kl_penalty = kl_reward_penalty(batch.old_logprobs, batch.ref_logprobs, batch.loss_mask, trainer.algo)
    values = batch.values if batch.values is not None else torch.zeros_like(batch.old_logprobs)
    # Whitening must use the statistics of the whole global batch, so with several ranks it happens here.
    whiten_globally = trainer.world > 1 and trainer.algo.whiten_advantages
    estimator_config = dataclasses.replace(trainer.algo, whiten_advantages=False) if whiten_globally else trainer.algo
    batch.advantages, batch.returns = estimate_advantages(
        trainer.algo.advantage, rewards=batch.rewards.to(trainer.device), values=values, loss_mask=batch.loss_mask,
        group_ids=batch.group_ids, config=estimator_config, kl_penalty=kl_penalty, turn_ids=batch.turn_ids)
    if whiten_globally:
        batch.advantages = process_group.distributed_whiten(batch.advantages, batch.loss_mask)
    mask = batch.loss_mask
    batch.stats["advantage/mean"] = float(batch.advantages[mask].mean()) if mask.any() else 0.0
    batch.stats["advantage/std"] = float(batch.advantages[mask].std()) if mask.sum() > 1 else 0.0
    # (with the sampler's log-probs as old ones there is no second measurement to compare: no mismatch metrics)
    weights, mismatch = (None, {}) if sampler_logprobs else rollout_correction_weights(
        batch.old_logprobs, batch.sample_logprobs, mask, batch.turn_ids, trainer.algo)
    batch.stats.update(mismatch)
    if weights is not None:  # w' >= 0 times the advantage = w' times each token's clipped surrogate
        batch.advantages = batch.advantages * weights
    if batch.ref_logprobs is not None and mask.any():
        batch.stats["kl_to_reference"] = float((batch.old_logprobs - batch.ref_logprobs)[mask].mean())
