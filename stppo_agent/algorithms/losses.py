"""Policy losses (clipped surrogate at token/turn/sequence level), critic loss, KL estimators.

Shapes: every per-token tensor is (B, T); ``loss_mask`` is bool; ``turn_ids`` is long (-1 off the mask).
Policy losses return ``(loss, bias_surrogate, metrics)``: ``bias_surrogate = agg(c_t * rho_t * A_t)`` with
c_t and A_t constant, whose gradient is the clipping bias C of docs/algorithms.md; ``metrics`` is a
:class:`~stppo_agent.algorithms.metrics.LossMetrics`: detached tensors (the values over the batch given), each with
the sums or extremes that combine it exactly over micro-batches and ranks (what the trainer logs).
A loss returns a ``bias_surrogate`` that does not require grad when nothing in the micro-batch is clipped: C's
share is then exactly zero, and the corrector skips its extra backward (every on-policy step: the first
mini-batch of each iteration, or all of them when one mini-batch is the whole batch).

``global_num_tokens`` / ``global_num_seqs`` let a trainer normalise a micro-batch by the size of the whole
optimizer batch, so that summing micro-batch gradients gives exactly the full-batch gradient.

``token_weights`` (B, T), >= 0 and constant, multiply each token's term of the policy loss (the rollout
correction's w', docs/algorithms.md); a token of weight 0 is dropped as if it had never been sampled
(:func:`policy_token_mask`): out of its segment's ratio, the counts and the KL / entropy terms.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch

from .config import AlgorithmConfig
from .hyperparameters import Hyperparameter, declare
from .metrics import LossMetrics, effective_sample_size
from .registry import Registry, accepts_keyword
from .segments import (
    broadcast_segments,
    masked_mean,
    masked_sum,
    segment_counts,
    segment_sum,
    turn_segment_ids,
)

KL_LOG_RATIO_CLAMP = 20.0  # verl's bound on l before exp(-l) in k3 / low_var_kl
PolicyLoss = Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str, fn: PolicyLoss | None = None, *, reads: Iterable[str] = (),
                         hyperparameters: Iterable[Hyperparameter] = ()):
    """Register ``fn`` under ``name`` (usable as a decorator). A taken name raises. ``reads``: the AlgorithmConfig
    fields the loss reads; ``hyperparameters``: its own (:mod:`stppo_agent.algorithms.hyperparameters`), both
    listed by ``stppo train --algo NAME --help``."""
    declare("policy loss", name, reads, hyperparameters, [f.name for f in dataclasses.fields(AlgorithmConfig)])
    if fn is None:
        return POLICY_LOSSES.decorator(name)
    return POLICY_LOSSES.register(name, fn)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered under ``name``; unknown names raise listing the known ones."""
    return POLICY_LOSSES[name]


# A loss whose mask is a statistic of the whole optimizer batch (M2PO's cut) cannot take it from the one
# micro-batch it is given: the current policy's log-probs of the other micro-batches do not exist yet when one is
# back-propagated. Such a loss registers a statistic here; the trainer then runs a no-grad forward over every
# micro-batch first and hands each micro-batch's loss call the keywords the statistic returns for it.
# statistic(logprobs=[...], old_logprobs=[...], loss_mask=[...], turn_ids=[...], config) -> [kwargs per micro-batch]
WHOLE_BATCH_STATISTICS: Registry[Callable[..., list[dict]]] = Registry("whole-batch statistic")


def register_whole_batch_statistic(loss_name: str, fn: Callable[..., list[dict]] | None = None):
    """Register the whole-batch statistic of the policy loss ``loss_name`` (usable as a decorator)."""
    if fn is None:
        return WHOLE_BATCH_STATISTICS.decorator(loss_name)
    return WHOLE_BATCH_STATISTICS.register(loss_name, fn)


def policy_token_mask(loss_mask: torch.Tensor, token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens a policy loss counts: ``loss_mask`` less those of weight 0 (dropped: a masked rollout-correction
    weight, a filler group of DAPO's dynamic sampling). A trainer counts the same tokens for ``global_num_tokens``
    / ``global_num_seqs``."""
    return loss_mask if token_weights is None else loss_mask & (token_weights > 0)


def token_weight_tensor(token_weights, loss_mask, like: torch.Tensor) -> torch.Tensor | None:
    """``token_weights`` detached, in ``like``'s dtype, 0 off ``loss_mask`` (None stays None: every weight 1)."""
    if token_weights is None:
        return None
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.where(loss_mask, token_weights.detach().to(like.dtype), zero)


def weighted(per_token: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``per_token`` times the token weights (unchanged without weights)."""
    return per_token if weights is None else per_token * weights


def call_policy_loss(loss_fn: PolicyLoss, *, token_weights: torch.Tensor | None = None, **kwargs):
    """``loss_fn(**kwargs)`` with per-token weights: as its ``token_weights`` keyword when it takes one (every rule
    here does; a ``**kwargs`` counts). A rule of one's own written without it gets them folded in instead: the
    weight-0 tokens taken off ``loss_mask``, the others' advantages multiplied by their weight -- the same loss for a
    rule linear in the advantage, as the clipped surrogate is."""
    if token_weights is None:
        return loss_fn(**kwargs)
    if accepts_keyword(loss_fn, "token_weights"):
        return loss_fn(token_weights=token_weights, **kwargs)
    mask = policy_token_mask(kwargs["loss_mask"], token_weights)
    advantages = kwargs["advantages"] * token_weight_tensor(token_weights, mask, kwargs["advantages"])
    return loss_fn(**{**kwargs, "loss_mask": mask, "advantages": advantages})


@torch.no_grad()
def learner_kl_metrics(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> LossMetrics:
    """``learner_kl_to_reference``: the mean of log pi_theta - log pi_ref (k1) over the policy tokens, pi_theta the
    policy being updated as the update's forward computed it (``kl_to_reference`` is the behaviour policy's)."""
    metrics = LossMetrics()
    metrics.mean("learner_kl_to_reference", masked_sum(logprobs.detach() - ref_logprobs, loss_mask), loss_mask.sum())
    return metrics


def log_ratio_at_level(logprobs, old_logprobs, loss_mask, turn_ids, level: str) -> torch.Tensor:
    """log rho at the requested level, per token: l_t, or the mean of l_t over the token's turn / sequence.

    exp of a segment mean is the geometric mean of the token ratios; the gradient flows to every token.
    """
    log_ratio = _ratios(logprobs, old_logprobs, loss_mask, turn_ids, level)[0]
    return torch.where(loss_mask, log_ratio, torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device))


def _ratios(logprobs, old_logprobs, loss_mask, turn_ids, level: str):
    """(log-ratio at ``level`` per token, detached (turn log-ratio sums, turn token counts)) for the metrics.

    The turn sums are computed once and shared between the turn-level ratio and ``turn_clip_frac``.
    """
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    token_log_ratio = torch.where(loss_mask, logprobs - old_logprobs, zero)
    turn_ids_flat, turn_segments = turn_segment_ids(turn_ids, loss_mask)
    turn_counts = segment_counts(turn_ids_flat, turn_segments, loss_mask, logprobs.dtype)
    if level == "token":
        with torch.no_grad():
            turn_sums = segment_sum(token_log_ratio, turn_ids_flat, turn_segments)
        return token_log_ratio, (turn_sums, turn_counts)
    if level == "turn":
        turn_sums = segment_sum(token_log_ratio, turn_ids_flat, turn_segments)
        # Off the mask this holds the mean of turn 0 (finite); every consumer masks those positions.
        means = broadcast_segments(turn_sums / turn_counts.clamp(min=1), turn_ids_flat)
        return means, (turn_sums.detach(), turn_counts)
    if level != "sequence":
        raise ValueError(f"unknown ratio level {level!r}; known: token, turn, sequence")
    # A whole trajectory is one segment: a row sum, no scatter needed.
    row_means = token_log_ratio.sum(1, keepdim=True) / loss_mask.sum(1, keepdim=True).clamp(min=1)
    means = row_means.expand_as(token_log_ratio)
    with torch.no_grad():
        turn_sums = segment_sum(token_log_ratio, turn_ids_flat, turn_segments)
    return torch.where(loss_mask, means, zero), (turn_sums, turn_counts)


def aggregate(per_token: torch.Tensor, loss_mask: torch.Tensor, mode: str, global_num_tokens=None,
              global_num_seqs=None, scale: float = 1.0) -> torch.Tensor:
    """token-mean: sum / number of policy tokens; seq-mean-token-mean: mean over trajectories of token means;
    seq-mean-token-sum-norm: mean over trajectories of token sums / ``scale`` (a constant, Dr. GRPO)."""
    total, count = aggregate_parts(per_token, loss_mask, mode, scale)
    denominator = global_num_tokens if mode == "token-mean" else global_num_seqs
    return total / (denominator if denominator is not None else count.clamp(min=1))


def aggregate_parts(per_token: torch.Tensor, loss_mask: torch.Tensor, mode: str,
                    scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, this batch's own count) of :func:`aggregate`: the sum over policy tokens and their number
    (token-mean), or the sum of per-trajectory token means (seq-mean-token-mean) or token sums / ``scale``
    (seq-mean-token-sum-norm) and the number of trajectories with policy tokens. Both add over micro-batches and
    ranks, so their ratio is the whole batch's mean."""
    if mode == "token-mean":
        return masked_sum(per_token, loss_mask), loss_mask.sum()
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
        sums = torch.where(loss_mask, per_token, zero).sum(1)
        per_seq = sums / loss_mask.sum(1).clamp(min=1) if mode == "seq-mean-token-mean" else sums / scale
        has_tokens = loss_mask.any(1)
        return torch.where(has_tokens, per_seq, zero).sum(), has_tokens.sum()
    raise ValueError(f"unknown loss_agg {mode!r}; known: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm")


def _aggregate_metric(metrics: LossMetrics, name: str, per_token: torch.Tensor, loss_mask: torch.Tensor,
                      mode: str, global_num_tokens=None, global_num_seqs=None, scale: float = 1.0) -> torch.Tensor:
    """:func:`aggregate`, recorded in ``metrics`` under ``name`` with its numerator and count as parts."""
    total, count = aggregate_parts(per_token, loss_mask, mode, scale)
    denominator = global_num_tokens if mode == "token-mean" else global_num_seqs
    value = total / (denominator if denominator is not None else count.clamp(min=1))
    metrics.mean(name, total, count, value=value)
    return value


def kl_estimate(logprobs, ref_logprobs, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from l = logprobs - ref_logprobs (Schulman's k1/k2/k3).

    k1 = l;  k2 = l^2 / 2;  k3 = exp(-l) - 1 + l;  low_var_kl = clamp(k3, -10, 10) (verl).
    k3 and low_var_kl clamp l to [-20, 20] before the exponential, as verl does: otherwise one position with
    l < -88 (float32), even a masked observation or padding position, makes exp overflow and its zero
    upstream gradient times inf puts NaN into the log-prob gradient of the whole row.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    log_ratio = log_ratio.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    k3 = torch.exp(-log_ratio) - 1 + log_ratio
    if estimator == "k3":
        return k3
    if estimator == "low_var_kl":
        return k3.clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; known: k1, k2, k3, low_var_kl")


def kl_reward_penalty(old_logprobs, ref_logprobs, loss_mask, config) -> torch.Tensor:
    """kl_in_reward * k1 at every policy token (0 elsewhere), for the advantage estimator's ``kl_penalty``."""
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    return torch.where(loss_mask, config.kl_in_reward * (old_logprobs - ref_logprobs), zero)


def _turn_clip_counts(turn_sums, turn_counts, config) -> tuple[torch.Tensor, torch.Tensor]:
    """(segments whose turn-level ratio left [1 - eps_low, 1 + eps_high], (trajectory, turn) segments present)."""
    present = turn_counts > 0
    turn_ratio = torch.exp(turn_sums / turn_counts.clamp(min=1))
    outside = (turn_ratio > 1 + config.clip_high) | (turn_ratio < 1 - config.clip_low)
    return (outside & present).sum().to(turn_sums.dtype), present.sum()


@torch.no_grad()
def _ratio_metrics(metrics: LossMetrics, logprobs, old_logprobs, ratio, clipped, loss_mask, turn_sums, turn_counts,
                   config) -> None:
    """Clip fractions and ratio statistics, each with the parts that combine it exactly over micro-batches."""
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    token_log_ratio = torch.where(loss_mask, logprobs - old_logprobs, zero)
    tokens = loss_mask.sum()
    metrics.mean("clip_frac", masked_sum(clipped.to(ratio.dtype), loss_mask), tokens)
    metrics.mean("turn_clip_frac", *_turn_clip_counts(turn_sums, turn_counts, config))
    metrics.mean("ratio/mean", masked_sum(ratio, loss_mask), tokens)
    metrics.extreme("ratio/max", torch.where(loss_mask, ratio, torch.full_like(ratio, -torch.inf)).max(), "max")
    metrics.extreme("ratio/min", torch.where(loss_mask, ratio, torch.full_like(ratio, torch.inf)).min(), "min")
    metrics.summed("ratio/ess", *effective_sample_size(_level_weights(ratio, loss_mask, turn_sums, turn_counts,
                                                                      config.ratio_level)))
    metrics.mean("approx_kl", masked_sum(torch.exp(token_log_ratio) - 1 - token_log_ratio, loss_mask), tokens)


def _level_weights(ratio, loss_mask, turn_sums, turn_counts, level: str) -> torch.Tensor:
    """One importance weight per sample at ``level``: each policy token's ratio, each (trajectory, turn)'s, or each
    trajectory's (a segment's tokens share its ratio, so it is counted once)."""
    if level == "turn":
        present = turn_counts > 0
        means = (turn_sums / turn_counts.clamp(min=1)).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        return torch.exp(means[present])
    if level == "sequence":
        rows = loss_mask.any(1)
        first = loss_mask.to(torch.int8).argmax(1)  # every token of a row holds the row's ratio
        return ratio.gather(1, first.unsqueeze(1)).squeeze(1)[rows]
    return ratio[loss_mask]


@register_policy_loss("ppo_clip", reads=("ratio_level", "clip_low", "clip_high", "clip_ratio_c"))
def ppo_clip_loss(*, logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, ref_logprobs=None,
                  entropy=None, global_num_tokens=None, global_num_seqs=None, token_weights=None):
    """Clipped surrogate L_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t), rho at config.ratio_level,
    times the token's weight when ``token_weights`` are given.

    Plus ``kl_loss_coef * agg(KL)`` when ``ref_logprobs`` is given and ``-entropy_coef * agg(entropy)`` when
    ``entropy`` is given. c_t = 1 where the clipped branch is strictly smaller.
    """
    agg_kwargs = aggregation_kwargs(config, global_num_tokens, global_num_seqs)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    loss_mask = policy_token_mask(loss_mask, token_weights)
    weights = token_weight_tensor(token_weights, loss_mask, logprobs)
    advantages = torch.where(loss_mask, advantages.detach().to(logprobs.dtype), zero)
    log_ratio, (turn_sums, turn_counts) = _ratios(logprobs, old_logprobs, loss_mask, turn_ids, config.ratio_level)
    # verl's bound before exp: a float32 log-ratio past 88 would make the unclipped branch (A < 0) infinite
    ratio = torch.exp(log_ratio.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP))
    clipped_ratio = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    surrogate = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    clipped = loss_mask & (((advantages > 0) & (ratio > 1 + config.clip_high))
                           | ((advantages < 0) & (ratio < 1 - config.clip_low)))
    metrics = LossMetrics()
    dual_c = getattr(config, "clip_ratio_c", None)
    if dual_c is not None:  # verl's dual clip: the A < 0 branch is worth at most -c * A, a constant
        dual = loss_mask & (advantages < 0) & (ratio > dual_c)
        surrogate = torch.where(dual, -dual_c * advantages, surrogate)
        clipped = clipped | dual  # the removed term is rho * A: it belongs in C like the ordinary clip's
        metrics.mean("dual_clip_frac", masked_sum(dual.to(ratio.dtype), loss_mask), loss_mask.sum())
    pg_loss = _aggregate_metric(metrics, "pg_loss", weighted(surrogate, weights), loss_mask, **agg_kwargs)
    bias_surrogate = aggregate(weighted(clipped.to(ratio.dtype) * ratio * advantages, weights), loss_mask,
                               **agg_kwargs)
    if not bool(clipped.any()):  # C's share is exactly 0: spare the corrector a whole backward pass
        bias_surrogate = bias_surrogate.detach()

    _ratio_metrics(metrics, logprobs.detach(), old_logprobs, ratio.detach(), clipped, loss_mask, turn_sums,
                   turn_counts, config)
    loss = add_regularisers(pg_loss, metrics, logprobs, loss_mask, config, agg_kwargs, ref_logprobs, entropy)
    return loss, bias_surrogate, metrics


def aggregation_kwargs(config, global_num_tokens=None, global_num_seqs=None) -> dict:
    """The keyword arguments of :func:`aggregate` a loss under ``config`` uses (a config of one's own without
    ``loss_scale_factor`` gets 1)."""
    return dict(mode=config.loss_agg, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                scale=getattr(config, "loss_scale_factor", 1.0))


def add_regularisers(pg_loss, metrics: LossMetrics, logprobs, loss_mask, config, agg_kwargs: dict,
                     ref_logprobs=None, entropy=None) -> torch.Tensor:
    """``pg_loss + kl_loss_coef * agg(KL) - entropy_coef * agg(entropy)``, the terms recorded in ``metrics``:
    what every policy loss adds to its surrogate."""
    loss = pg_loss
    if ref_logprobs is not None and config.kl_loss_coef > 0:
        kl = _aggregate_metric(metrics, "kl_loss", kl_estimate(logprobs, ref_logprobs, config.kl_estimator),
                               loss_mask, **agg_kwargs)
        loss = loss + config.kl_loss_coef * kl
    if entropy is not None:
        mean_entropy = _aggregate_metric(metrics, "entropy", entropy, loss_mask, **agg_kwargs)
        loss = loss - config.entropy_coef * mean_entropy
    return loss


def value_loss(*, values, old_values, returns, loss_mask, config, global_num_tokens=None):
    """Critic loss 0.5 * max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2), token-mean over policy tokens.

    Returns (loss, metrics) with ``value_loss``, ``value_clip_frac`` and ``explained_variance`` (a
    :class:`LossMetrics`: each with the parts that combine it exactly over micro-batches and ranks).
    """
    returns = returns.detach()
    # clamp V itself (as verl's clip_by_value does): inside the range the clipped value IS V, so the two errors are
    # equal and no token counts as clipped; old + (V - old) rounds away from V when their magnitudes differ
    clipped_values = torch.clamp(values, old_values - config.value_clip, old_values + config.value_clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_error, clipped_error)
    metrics = LossMetrics()
    loss = _aggregate_metric(metrics, "value_loss", per_token, loss_mask, "token-mean",
                             global_num_tokens=global_num_tokens)
    clipped = (clipped_error > unclipped_error).to(values.dtype)
    metrics.mean("value_clip_frac", masked_sum(clipped.detach(), loss_mask), loss_mask.sum(),
                 value=masked_mean(clipped, loss_mask))
    predictions = values.detach()
    metrics.summed("explained_variance", explained_variance(predictions, returns, loss_mask),
                   _variance_sums(predictions, returns, loss_mask), _explained_variance_from_sums)
    return loss, metrics


def explained_variance(predictions, targets, loss_mask) -> torch.Tensor:
    """1 - Var(targets - predictions) / Var(targets) over policy tokens (NaN-free: 0 when Var(targets) is 0)."""
    residual_var = masked_mean((targets - predictions - masked_mean(targets - predictions, loss_mask)) ** 2, loss_mask)
    target_var = masked_mean((targets - masked_mean(targets, loss_mask)) ** 2, loss_mask)
    return torch.where(target_var > 0, 1 - residual_var / target_var.clamp(min=1e-12), torch.zeros_like(target_var))


def _variance_sums(predictions, targets, loss_mask) -> torch.Tensor:
    """Sums of residual, residual^2, target, target^2 and the token count, in float64 (the variances are
    differences of these sums)."""
    residual, targets = (targets - predictions).double(), targets.double()
    return torch.stack([masked_sum(residual, loss_mask), masked_sum(residual**2, loss_mask),
                        masked_sum(targets, loss_mask), masked_sum(targets**2, loss_mask),
                        loss_mask.sum().double()])


def _explained_variance_from_sums(sums: torch.Tensor) -> torch.Tensor:
    """:func:`explained_variance` over the tokens whose :func:`_variance_sums` were added up. A variance from sums
    is a difference of two near-equal numbers: below 1e-10 of the mean square it is rounding, and counts as 0."""
    residual, residual_sq, target, target_sq, count = sums
    count = count.clamp(min=1)
    residual_var = (residual_sq / count - (residual / count) ** 2).clamp(min=0)
    target_var = (target_sq / count - (target / count) ** 2).clamp(min=0)
    varies = target_var > 1e-10 * target_sq / count
    return torch.where(varies, 1 - residual_var / target_var.clamp(min=1e-12), torch.zeros_like(target_var))
