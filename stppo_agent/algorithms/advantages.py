"""Advantage estimators (docs/algorithms.md, "Advantage estimators"), registered by name.

Every estimator has the signature
``fn(*, rewards, values, loss_mask, group_ids, config, kl_penalty=None, turn_ids=None) -> (advantages, returns)``
with rewards (B,), values (B, T), loss_mask (B, T) bool, group_ids (B,) long, optional kl_penalty (B, T) (the
per-token penalty already multiplied by its coefficient) and turn_ids (B, T) long (-1 off the mask; needed by
``turn_gae``), and returns two (B, T) tensors that are 0 off ``loss_mask``. ``returns`` is what the critic
regresses to (for critic-free estimators it equals advantages). An estimator written without a ``turn_ids``
parameter works too: :func:`estimate_advantages` passes it only to those that accept it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch

from .config import AlgorithmConfig
from .hyperparameters import Hyperparameter, declare
from .registry import Registry, accepts_keyword
from .segments import check_turn_ids, discounted_reverse_cumsum, whiten

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


GROUP_ESTIMATORS = {"grpo", "rloo"}
"""Estimators that compare a trajectory with the others of its group: a group of one has advantage 0 and teaches
nothing, so they need samples_per_prompt >= 2 (add a user estimator's name here when it is group-based too)."""
UNWHITENED_ESTIMATORS = {"grpo", "rloo"}
"""Estimators whose advantages are normalised within their groups and never whitened over the batch, whatever
``whiten_advantages`` says: with several processes the trainer must not whiten them globally either."""


def register_advantage_estimator(name: str, fn: AdvantageEstimator | None = None, *, reads: Iterable[str] = (),
                                 hyperparameters: Iterable[Hyperparameter] = ()):
    """Register ``fn`` under ``name`` (usable as a decorator). A taken name raises. ``reads`` and
    ``hyperparameters`` as for :func:`~stppo_agent.algorithms.losses.register_policy_loss`."""
    declare("advantage estimator", name, reads, hyperparameters, [f.name for f in dataclasses.fields(AlgorithmConfig)])
    if fn is None:
        return ADVANTAGE_ESTIMATORS.decorator(name)
    return ADVANTAGE_ESTIMATORS.register(name, fn)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``; unknown names raise listing the known ones."""
    return ADVANTAGE_ESTIMATORS[name]


def estimate_advantages(name: str, *, turn_ids: torch.Tensor | None = None, **kwargs):
    """Run the estimator registered under ``name`` with ``kwargs``, adding ``turn_ids`` when it takes them (a
    ``turn_ids`` parameter or ``**kwargs``): the trainer's one call for every estimator, including one written
    without them."""
    estimator = get_advantage_estimator(name)
    if accepts_keyword(estimator, "turn_ids"):
        kwargs["turn_ids"] = turn_ids
    return estimator(**kwargs)


def compact_policy_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the column order that puts policy positions first (in order), then the rest.

    ``x.gather(1, order)`` compacts a (B, T) tensor to its policy tokens t_1 < ... < t_n; ``scatter`` undoes it.
    """
    return torch.argsort((~loss_mask).to(torch.int8), dim=1, stable=True)


@register_advantage_estimator("gae", reads=("gamma", "lam", "whiten_advantages"))
def gae_advantages(*, rewards, values, loss_mask, group_ids=None, config, kl_penalty=None, turn_ids=None):
    """Multi-turn GAE over policy tokens only (observation tokens are skipped, not zero-reward steps).

    delta_j = r_j + gamma * V(t_{j+1}) - V(t_j), V(t_{n+1}) = 0;  A_j = delta_j + gamma * lambda * A_{j+1}
    r_j = -kl_penalty(t_j) + [j == n] * reward;  returns_j = A_j + V(t_j); A whitened unless disabled.
    """
    order = compact_policy_positions(loss_mask)
    mask_c = loss_mask.gather(1, order)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values_c = torch.where(mask_c, values.gather(1, order), zero)
    next_mask = torch.nn.functional.pad(mask_c[:, 1:], (0, 1), value=False)
    next_values = torch.where(next_mask, torch.nn.functional.pad(values_c[:, 1:], (0, 1)), zero)
    is_last = mask_c & ~next_mask
    token_rewards = torch.where(is_last, rewards.to(values.dtype).unsqueeze(1), zero)
    if kl_penalty is not None:
        token_rewards = token_rewards - torch.where(mask_c, kl_penalty.gather(1, order), zero)
    deltas = torch.where(mask_c, token_rewards + config.gamma * next_values - values_c, zero)
    advantages_c = torch.where(mask_c, discounted_reverse_cumsum(deltas, config.gamma * config.lam), zero)
    returns_c = torch.where(mask_c, advantages_c + values_c, zero)
    advantages = torch.zeros_like(values).scatter(1, order, advantages_c)
    returns = torch.zeros_like(values).scatter(1, order, returns_c)
    if config.whiten_advantages:
        advantages = whiten(advantages, loss_mask)
    return advantages, returns


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-trajectory group sum, group size and unbiased group std (segment reductions over groups)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max().item()) + 1
    sums = torch.zeros(groups, dtype=scores.dtype, device=scores.device).index_add(0, inverse, scores)
    sizes = torch.zeros(groups, dtype=scores.dtype, device=scores.device).index_add(
        0, inverse, torch.ones_like(scores))
    means = sums / sizes
    squares = torch.zeros(groups, dtype=scores.dtype, device=scores.device).index_add(
        0, inverse, (scores - means[inverse]) ** 2)
    stds = torch.sqrt(squares / (sizes - 1).clamp(min=1))
    return sums[inverse], sizes[inverse], stds[inverse]


def outcome_scores(rewards: torch.Tensor, loss_mask: torch.Tensor, kl_penalty: torch.Tensor | None) -> torch.Tensor:
    """Each trajectory's score for an outcome-reward estimator: R_b minus the sum of its per-token KL penalties.

    As verl does with ``use_kl_in_reward``: its token-level rewards (the outcome at the last token, minus
    ``kl_ctrl * kl`` at every token, ``apply_kl_penalty``) are summed per sequence before the group baseline
    (``compute_grpo_outcome_advantage`` / ``compute_rloo_outcome_advantage``). So a trajectory that drifted further
    from the reference ranks lower in its group, and a penalty shared by the whole group cancels in the baseline.
    """
    scores = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    if kl_penalty is None:
        return scores
    zero = torch.zeros((), dtype=kl_penalty.dtype, device=kl_penalty.device)
    return scores - torch.where(loss_mask, kl_penalty, zero).sum(1).to(scores.dtype)


def _broadcast(per_trajectory: torch.Tensor, loss_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=loss_mask.device)
    return torch.where(loss_mask, per_trajectory.to(dtype).unsqueeze(1), zero)


@register_advantage_estimator("grpo", reads=("grpo_std_normalize",))
def grpo_advantages(*, rewards, values=None, loss_mask, group_ids, config, kl_penalty=None, turn_ids=None):
    """A_b = (S_b - mean_g S) / (std_g S + 1e-6), or without the division (Dr. GRPO); broadcast to tokens.

    S_b = R_b - sum of b's per-token KL penalties (:func:`outcome_scores`). A trajectory alone in its group has no
    baseline and gets advantage 0.
    """
    scores = outcome_scores(rewards, loss_mask, kl_penalty)
    sums, sizes, stds = _group_stats(scores, group_ids)
    advantage = scores - sums / sizes
    if config.grpo_std_normalize:
        advantage = advantage / (stds + 1e-6)
    advantage = torch.where(sizes > 1, advantage, torch.zeros_like(advantage))
    dtype = values.dtype if values is not None else scores.dtype
    advantages = _broadcast(advantage, loss_mask, dtype)
    return advantages, advantages


@register_advantage_estimator("rloo")
def rloo_advantages(*, rewards, values=None, loss_mask, group_ids, config, kl_penalty=None, turn_ids=None):
    """A_b = S_b - mean of S over the other members of b's group (0 for a trajectory alone); broadcast.
    S_b as in :func:`grpo_advantages`."""
    scores = outcome_scores(rewards, loss_mask, kl_penalty)
    sums, sizes, _ = _group_stats(scores, group_ids)
    leave_one_out = (sums - scores) / (sizes - 1).clamp(min=1)
    advantage = torch.where(sizes > 1, scores - leave_one_out, torch.zeros_like(scores))
    dtype = values.dtype if values is not None else scores.dtype
    advantages = _broadcast(advantage, loss_mask, dtype)
    return advantages, advantages


@register_advantage_estimator("turn_gae", reads=("gamma", "lam", "whiten_advantages"))
def turn_gae_advantages(*, rewards, values, loss_mask, group_ids=None, config, kl_penalty=None, turn_ids=None):
    """GAE over the turns of each trajectory (one env.step is one step), shared by every token of the turn.

    For the turns k_1 < ... < k_m a trajectory has (by turn id), V_i = the critic's value at turn k_i's first
    policy token (the state the turn starts from), r_i = -sum of kl_penalty over turn k_i + [i == m] * reward;
    delta_i = r_i + gamma * V_{i+1} - V_i (V_{m+1} = 0), A_i = delta_i + gamma * lambda * A_{i+1}; every token of turn
    k_i gets A_i and returns A_i + V_i; gamma and lambda are per turn. Whitened over policy tokens unless disabled.
    """
    if turn_ids is None:
        raise ValueError("turn_gae needs turn_ids: call it through estimate_advantages(..., turn_ids=batch.turn_ids)")
    check_turn_ids(turn_ids, loss_mask)
    batch, length = loss_mask.shape
    dtype, device = values.dtype, values.device
    zero = torch.zeros((), dtype=dtype, device=device)
    # (B, T) grids indexed by turn id: turn ids are < T, so no segment can be lost.
    turns = torch.where(loss_mask, turn_ids, torch.zeros_like(turn_ids))
    positions = torch.arange(length, device=device).expand(batch, length)
    first = torch.full((batch, length), length, dtype=torch.long, device=device).scatter_reduce(
        1, turns, torch.where(loss_mask, positions, length), "amin")
    present = first < length
    turn_values = torch.where(present, values.gather(1, first.clamp(max=length - 1)), zero)
    penalties = torch.zeros((batch, length), dtype=dtype, device=device)
    if kl_penalty is not None:
        penalties = penalties.scatter_add(1, turns, torch.where(loss_mask, kl_penalty.to(dtype), zero))
    order = compact_policy_positions(present)  # the present turns first, in turn order
    present_c = present.gather(1, order)
    values_c = turn_values.gather(1, order)
    next_present = torch.nn.functional.pad(present_c[:, 1:], (0, 1), value=False)
    next_values = torch.where(next_present, torch.nn.functional.pad(values_c[:, 1:], (0, 1)), zero)
    is_last = present_c & ~next_present
    turn_rewards = torch.where(is_last, rewards.to(dtype).unsqueeze(1), zero) - penalties.gather(1, order)
    deltas = torch.where(present_c, turn_rewards + config.gamma * next_values - values_c, zero)
    advantages_c = torch.where(present_c, discounted_reverse_cumsum(deltas, config.gamma * config.lam), zero)
    turn_advantages = torch.zeros_like(values_c).scatter(1, order, advantages_c)
    advantages = torch.where(loss_mask, turn_advantages.gather(1, turns), zero)
    returns = torch.where(loss_mask, (turn_advantages + turn_values).gather(1, turns), zero)
    if config.whiten_advantages:
        advantages = whiten(advantages, loss_mask)
    return advantages, returns
