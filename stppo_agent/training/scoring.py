"""Scoring a rollout batch before the update: the log-probs the PPO ratios start from, the reference's for the KL
terms, the critic's values, the advantages (whitened over the global batch when there are several ranks), and the
per-token weights of the policy loss."""

from __future__ import annotations

import dataclasses

import torch

from stppo_agent.algorithms import (
    AlgorithmConfig,
    estimate_advantages,
    kl_reward_penalty,
    rollout_correction_weights,
)
from stppo_agent.algorithms.advantages import UNWHITENED_ESTIMATORS
from stppo_agent.distributed import process_group
from stppo_agent.rollouts.batch import RolloutBatch
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.log_probs import batched_no_grad, critic_values, token_logprobs
from stppo_agent.training.resampling import without_fillers
from stppo_agent.training.stale_policy import is_decoupled


def old_logprobs_from_update(config: TrainConfig, algo: AlgorithmConfig, *, batch_size: int, lag: int, world: int,
                             reference: torch.nn.Module | None) -> bool:
    """Whether the PPO ratio's denominator is taken from the update's own forward instead of a scoring forward:
    when the update is a single optimizer step on the whole batch, by the weights that sampled it, the
    denominator is that forward's log-probs, detached (what TRL does when it takes one step per batch). Every
    ratio is then exactly 1, as recomputed ones are up to rounding, for one forward of the actor fewer. Not when
    anything needs the denominator before the update -- a rollout correction's weights, a reference's KL columns
    and KL-in-reward penalty -- nor with a lagged generator, the decoupled objective, or several processes (each
    holds a share of every mini-batch); not with ``rollout.old_logprobs=sampler``, which takes no forward at all."""
    return (config.rollout.old_logprobs == "recompute" and lag == 0 and not is_decoupled(config) and world == 1
            and config.optimizer.epochs == 1 and batch_size <= config.optimizer.mini_batch_size
            and algo.rollout_correction == "none" and reference is None)


@torch.no_grad()
def finish_scoring(batch: RolloutBatch, algo: AlgorithmConfig) -> None:
    """After an update that took the denominator from its own forward (:func:`old_logprobs_from_update`): the
    sampler/learner mismatch statistics scoring would have measured, over the whole batch."""
    batch.stats.update(rollout_correction_weights(batch.old_logprobs, batch.sample_logprobs, batch.loss_mask,
                                                  batch.turn_ids, algo)[1])


@torch.no_grad()
def score_batch(batch: RolloutBatch, *, config: TrainConfig, algo: AlgorithmConfig, actor: torch.nn.Module,
                generator: torch.nn.Module, reference: torch.nn.Module | None, critic: torch.nn.Module | None,
                device: torch.device, world: int = 1, old_from_update: bool = False) -> None:
    """Set on ``batch``: ``old_logprobs`` (the PPO ratio's denominator), ``ref_logprobs`` (with a ``reference``),
    ``values`` (with a ``critic``), ``advantages`` and ``returns``, and ``token_weights``: the rollout-correction
    weights, 0 on DAPO's filler groups (None when every weight is 1); and its ``advantage/...``, mismatch and
    ``kl_to_reference`` stats. ``generator``: the weights that sampled the batch (the lagged copy under
    ``rollout.staleness``, else ``actor``); ``world``: the processes sharing the global batch;
    ``old_from_update``: leave ``old_logprobs`` None for the update's forward to fill
    (:func:`old_logprobs_from_update` says when that is the same denominator) and :func:`finish_scoring` to
    measure."""
    micro, sampling = config.optimizer.micro_batch_size, config.sampling()

    def scored(model):  # under the distribution the rollout sampled from (as verl)
        # Under FSDP2 each model is gathered once for all its micro-batches (one all-gather instead of one per
        # micro-batch), and one model at a time, so at most one full copy of weights is held.
        with process_group.gathered(model):
            return batched_no_grad(lambda m, b: token_logprobs(m, b, sampling=sampling), model, batch, micro)

    # The PPO ratio's denominator: the policy that sampled the batch (the actor itself unless rollout_staleness lags
    # the generator), or for decoupled PPO the proximal policy, the actor before this update; with
    # old_logprobs=sampler, what the sampler computed while generating, in its own precision (no forward here).
    decoupled = is_decoupled(config)
    sampler_logprobs = config.rollout.old_logprobs == "sampler"
    if sampler_logprobs:
        batch.old_logprobs = batch.sample_logprobs.to(device, torch.float32, copy=True)
    elif old_from_update:
        batch.old_logprobs = None
    else:
        batch.old_logprobs = scored(actor if decoupled else generator)
    if reference is not None:
        batch.ref_logprobs = scored(reference)
    if critic is not None:
        with process_group.gathered(critic):
            batch.values = batched_no_grad(critic_values, critic, batch, micro)
    # The KL columns and the reward's KL penalty are the behaviour policy's under both objectives: one more forward
    # of the lagged weights under decoupled, where the ratio's denominator is another policy.
    behaviour = batch.old_logprobs
    if decoupled and batch.ref_logprobs is not None:
        behaviour = scored(generator)
    kl_penalty = None
    if algo.kl_in_reward > 0 and batch.ref_logprobs is not None:
        kl_penalty = kl_reward_penalty(behaviour, batch.ref_logprobs, batch.loss_mask, algo)
    values = batch.values if batch.values is not None else \
        torch.zeros(batch.loss_mask.shape, dtype=torch.float32, device=batch.loss_mask.device)  # critic-free
    # Whitening must use the statistics of the whole global batch, so with several ranks it happens here.
    whiten_globally = world > 1 and algo.whiten_advantages and algo.advantage not in UNWHITENED_ESTIMATORS
    estimator_config = dataclasses.replace(algo, whiten_advantages=False) if whiten_globally else algo
    batch.advantages, batch.returns = estimate_advantages(
        algo.advantage, rewards=batch.rewards.to(device), values=values, loss_mask=batch.loss_mask,
        group_ids=batch.group_ids, config=estimator_config, kl_penalty=kl_penalty, turn_ids=batch.turn_ids)
    if whiten_globally:
        batch.advantages = process_group.distributed_whiten(batch.advantages, batch.loss_mask)
    mask = batch.loss_mask
    batch.stats["advantage/mean"] = float(batch.advantages[mask].mean()) if mask.any() else 0.0
    batch.stats["advantage/std"] = float(batch.advantages[mask].std()) if mask.sum() > 1 else 0.0
    # (with the sampler's log-probs as old ones there is no second measurement to compare: no mismatch metrics)
    weights, mismatch = (None, {}) if sampler_logprobs or old_from_update else rollout_correction_weights(
        batch.old_logprobs, batch.sample_logprobs, mask, batch.turn_ids, algo)
    batch.stats.update(mismatch)
    # each rule weights its own per-token terms (a sequence-level rule's are not a sum the advantage could carry)
    batch.token_weights = without_fillers(weights, batch) if algo.dynamic_sampling else weights
    if batch.ref_logprobs is not None and mask.any():
        batch.stats["kl_to_reference"] = float((behaviour - batch.ref_logprobs)[mask].mean())
