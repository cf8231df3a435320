"""DAPO's dynamic sampling in the live rollouts (``dynamic_sampling`` of the algorithm, on in the ``dapo`` preset).

A group whose trajectories all earned the same reward teaches a group-relative rule nothing. Such groups are
dropped and this iteration's prompts are followed by more, one full round of ``rollout.prompts_per_iteration`` at a
time, until every rank holds as many informative groups as it had groups, or ``max_resample_rounds`` extra rounds are
spent (0: no cap, verl's ``max_num_gen_batches`` meaning); then the batch is filled up with dropped groups so that
every iteration has the same shape. The fillers are out of the update (:func:`without_fillers`: token weight 0):
no gradient, and no place in the token-mean or sequence-mean denominator, so they do not shrink the other groups'
step. Ranks take their rounds together (the prompt sampler is shared), so one short rank makes all of them sample
another round. Every round, the extra ones too, passes the trainer's ``monitor.max_search_error_rate`` check.

Logged: ``dynamic_sampling/rounds`` (extra rounds taken) and ``dynamic_sampling/dropped_frac`` (share of the sampled
groups that were uninformative). The iteration's other rollout statistics (reward, ...) stay those of its first
round: the policy's own performance on the iteration's prompts, comparable with runs of other rules.
"""

from __future__ import annotations

from typing import Callable

import torch

from stppo_agent.algorithms import dropped_group_count, informative_groups
from stppo_agent.distributed import process_group
from stppo_agent.rollouts.batch import RolloutBatch
from stppo_agent.rollouts.global_batch import merge_shares


def check_dynamic_sampling(algo, samples_per_prompt: int) -> None:
    """Refuse (one line) dynamic sampling where no group can ever be informative: a group of one trajectory. With a
    critic's advantage (gae, turn_gae) a group whose rewards all agree still has advantages (the critic's); dropping
    it is then a choice of what to train on, not a saving, and it is allowed (VAPO pairs value-based PPO with
    dynamic sampling; the demo uses it so that its one small batch always holds a reward spread)."""
    if not algo.dynamic_sampling:
        return
    if samples_per_prompt < 2:
        raise ValueError("algorithm.dynamic_sampling needs groups of >= 2 trajectories (a group of one never differs "
                         "in reward, so every round would be dropped): set rollout.samples_per_prompt >= 2")


def without_fillers(weights: torch.Tensor | None, batch: RolloutBatch) -> torch.Tensor:
    """The per-token policy-loss weights ``weights`` (None: all 1) with 0 on every group whose rewards are all
    equal: the fillers :func:`keep_informative_groups` kept for the batch's shape."""
    informative = informative_groups(batch.rewards, batch.group_ids).to(batch.loss_mask.device)
    kept = batch.loss_mask & informative.unsqueeze(1)
    base = weights if weights is not None else torch.ones(batch.loss_mask.shape, device=batch.loss_mask.device)
    return torch.where(kept, base, torch.zeros((), dtype=base.dtype, device=base.device))


def keep_informative_groups(first: RolloutBatch, play_round: Callable[[int], RolloutBatch], max_rounds: int,
                            pad_id: int) -> RolloutBatch:
    """``first`` with its uninformative groups replaced by informative ones from ``play_round(r)``, r = 1, 2, ...
    (at most ``max_rounds`` of them; 0: until every rank is full)."""
    shares, rounds = [first], 0
    groups_needed = int(torch.unique(first.group_ids).numel())
    while True:
        merged = merge_shares(shares, pad_id, dict(first.stats)) if len(shares) > 1 else first
        keep = informative_groups(merged.rewards, merged.group_ids)
        informative = int(torch.unique(merged.group_ids[keep]).numel())
        # any rank still short makes every rank play another round (a gathered object: rewards live on the CPU,
        # which an NCCL all-reduce would refuse)
        capped = max_rounds > 0 and rounds >= max_rounds
        if capped or not any(process_group.all_gather_objects(informative < groups_needed)):
            break
        rounds += 1
        shares.append(play_round(rounds))
    sampled, dropped = int(torch.unique(merged.group_ids).numel()), dropped_group_count(keep, merged.group_ids)
    order = _groups_in_order(merged.group_ids, keep)[:groups_needed]
    rows = torch.cat([torch.nonzero(merged.group_ids == group).flatten() for group in order])
    batch = merged.select(rows)
    batch.stats = {**first.stats, "dynamic_sampling/rounds": float(rounds),
                   "dynamic_sampling/dropped_frac": dropped / max(sampled, 1)}
    return batch


def _groups_in_order(group_ids: torch.Tensor, keep: torch.Tensor) -> list[int]:
    """Informative groups first, then the dropped ones, each in sampling order."""
    seen: list[int] = []
    for wanted in (True, False):
        for group, kept in zip(group_ids.tolist(), keep.tolist()):
            if kept == wanted and group not in seen:
                seen.append(group)
    return seen
