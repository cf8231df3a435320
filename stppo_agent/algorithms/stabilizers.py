"""Off-policy stabilisers of 2025-26 as policy losses (docs/algorithms.md, "Stabilisers"): CISPO, SAPO, GMPO,
DPPO-TV / DPPO-KL and M2PO, each at ``config.ratio_level`` token, turn or sequence.

Same keywords and outputs as ``ppo_clip``; ``token_weights`` multiply each token's term (a token of weight 0 is
dropped: out of its segment's mean, M2PO's statistic and every count). ``bias_surrogate`` is, like C of the clipped
surrogate, a surrogate whose gradient is the part of the importance-weighted gradient grad agg(rho A) that the rule
removed: agg(sg(1 - w / rho) rho A) with w the rule's effective weight (GMPO: agg(rho A) - agg(rho~ A), its clipped
ratio); at token level it is exactly grad agg(rho A) + grad pg_loss. Detached when the rule removed nothing.
``clip_frac`` is the share of policy tokens the rule changed (clipped, masked or truncated; SAPO: the mean share of
gradient weight its gate removed), ``turn_clip_frac`` the share of (trajectory, turn) segments with such a token.
"""

from __future__ import annotations

import dataclasses

import torch

from .losses import (
    KL_LOG_RATIO_CLAMP,
    _aggregate_metric,
    _ratio_metrics,
    _ratios,
    add_regularisers,
    aggregate,
    aggregation_kwargs,
    log_ratio_at_level,
    policy_token_mask,
    register_policy_loss,
    register_whole_batch_statistic,
    token_weight_tensor,
    weighted,
)
from .metrics import LossMetrics
from .second_moment import m2po_keep_mask, m2po_keep_masks
from .segments import masked_sum, segment_sum, turn_segment_ids


@dataclasses.dataclass
class _Batch:
    """What every rule starts from: the policy tokens (less those of weight 0), masked advantages, the level
    log-ratio (clamped to [-20, 20] before exp, as verl does, so a far-off token cannot overflow) and its ratio,
    both carrying gradient, and the token weights (None: every weight 1)."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    turn_ids: torch.Tensor
    config: object
    agg: dict
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    turn_sums: torch.Tensor
    turn_counts: torch.Tensor
    weights: torch.Tensor | None

    @property
    def zero(self) -> torch.Tensor:
        return torch.zeros((), dtype=self.logprobs.dtype, device=self.logprobs.device)

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.loss_mask, x, self.zero)

    def aggregate(self, per_token: torch.Tensor) -> torch.Tensor:
        """agg of the weighted per-token terms over the policy tokens."""
        return aggregate(weighted(per_token, self.weights), self.loss_mask, **self.agg)

    def level_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of ``x`` over each position's segment at the ratio level (x itself at token level)."""
        return log_ratio_at_level(x, torch.zeros_like(x), self.loss_mask, self.turn_ids, self.config.ratio_level)


def _level_log_ratio(logprobs, old_logprobs, loss_mask, turn_ids, level: str):
    """The rules' log-ratio at ``level`` (clamped to [-20, 20], 0 off the mask) and the (turn sums, turn counts)
    it was taken from."""
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio, turns = _ratios(logprobs, old_logprobs, loss_mask, turn_ids, level)
    return torch.where(loss_mask, log_ratio.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP), zero), turns


def _batch(logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, global_num_tokens, global_num_seqs,
           token_weights=None):
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    loss_mask = policy_token_mask(loss_mask, token_weights)
    advantages = torch.where(loss_mask, advantages.detach().to(logprobs.dtype), zero)
    log_ratio, (turn_sums, turn_counts) = _level_log_ratio(logprobs, old_logprobs, loss_mask, turn_ids,
                                                           config.ratio_level)
    return _Batch(logprobs, old_logprobs, advantages, loss_mask, turn_ids, config,
                  aggregation_kwargs(config, global_num_tokens, global_num_seqs), log_ratio, torch.exp(log_ratio),
                  turn_sums, turn_counts, token_weight_tensor(token_weights, loss_mask, logprobs))


def _finish(b: _Batch, per_token, changed, bias_surrogate, ref_logprobs, entropy, changed_share=None):
    """Weight each token's term, aggregate, record the metrics, add the KL / entropy terms: the common tail of
    every rule."""
    metrics = LossMetrics()
    pg_loss = _aggregate_metric(metrics, "pg_loss", weighted(per_token, b.weights), b.loss_mask, **b.agg)
    changed = changed & b.loss_mask
    if not bool(changed.any()):  # the rule equals importance sampling here: spare the corrector a backward
        bias_surrogate = bias_surrogate.detach()
    _ratio_metrics(metrics, b.logprobs.detach(), b.old_logprobs, b.ratio.detach(), changed, b.loss_mask,
                   b.turn_sums, b.turn_counts, b.config)
    with torch.no_grad():
        if changed_share is not None:
            metrics.mean("clip_frac", masked_sum(changed_share, b.loss_mask), b.loss_mask.sum())
        ids, num = turn_segment_ids(b.turn_ids, b.loss_mask)
        touched = segment_sum(changed.to(b.ratio.dtype), ids, num) > 0
        metrics.mean("turn_clip_frac", touched.sum().to(b.ratio.dtype), (b.turn_counts > 0).sum())
    loss = add_regularisers(pg_loss, metrics, b.logprobs, b.loss_mask, b.config, b.agg, ref_logprobs, entropy)
    return loss, bias_surrogate, metrics


def _removed_share_bias(b: _Batch, effective_weight: torch.Tensor) -> torch.Tensor:
    """agg(sg(1 - w / rho) rho A): its gradient (rho - w) A grad l is what the rule's weight w took away from
    importance sampling (negative where w > rho: CISPO's lower bound raises small weights)."""
    removed = 1 - effective_weight.detach() / b.ratio.detach()
    return b.aggregate(removed * b.ratio * b.advantages)


@register_policy_loss("cispo", reads=("ratio_level", "clip_low", "clip_high"))
def cispo_loss(*, logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, ref_logprobs=None, entropy=None,
               global_num_tokens=None, global_num_seqs=None, token_weights=None):
    """CISPO (MiniMax-M1): L_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t); every token keeps a
    gradient, clipping only caps its weight."""
    b = _batch(logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, global_num_tokens, global_num_seqs,
               token_weights)
    weight = b.ratio.detach().clamp(1 - config.clip_low, 1 + config.clip_high)
    per_token = -weight * b.advantages * b.masked(logprobs)
    changed = (b.ratio > 1 + config.clip_high) | (b.ratio < 1 - config.clip_low)
    return _finish(b, per_token, changed, _removed_share_bias(b, weight), ref_logprobs, entropy)


@register_policy_loss("sapo", reads=("ratio_level", "tau_pos", "tau_neg"))
def sapo_loss(*, logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, ref_logprobs=None, entropy=None,
              global_num_tokens=None, global_num_seqs=None, token_weights=None):
    """SAPO: L_t = -f(rho_t) A_t, f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos for A_t > 0 else tau_neg. f'(1)
    = 1 (on-policy it is the plain policy gradient); the gradient weight 4 s (1 - s) fades smoothly off-policy."""
    b = _batch(logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, global_num_tokens, global_num_seqs,
               token_weights)
    taus = torch.where(b.advantages > 0, torch.full_like(b.ratio, config.tau_pos),
                       torch.full_like(b.ratio, config.tau_neg))
    gate = torch.sigmoid(taus * (b.ratio - 1))
    per_token = -(gate * 4 / taus) * b.advantages
    gate = gate.detach()
    removed = 1 - 4 * gate * (1 - gate)
    bias = b.aggregate(removed * b.ratio * b.advantages)
    return _finish(b, per_token, removed != 0, bias, ref_logprobs, entropy, changed_share=removed)


@register_policy_loss("gmpo", reads=("ratio_level", "clip_low", "clip_high"))
def gmpo_loss(*, logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, ref_logprobs=None, entropy=None,
              global_num_tokens=None, global_num_seqs=None, token_weights=None):
    """GMPO: the token log-ratios are clipped in log space, sign-aware (A > 0: min(l, eps_high); A < 0:
    max(l, -eps_low); A = 0: 0), averaged over the segment (a geometric mean of the ratios), L_t = -A_t exp(mean)."""
    b = _batch(logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, global_num_tokens, global_num_seqs,
               token_weights)
    token_log_ratio = b.masked(logprobs - old_logprobs)
    sign = torch.sign(b.advantages)
    bounded = token_log_ratio.clamp(-config.clip_low, config.clip_high)
    clipped = sign * torch.minimum(sign * token_log_ratio, sign * bounded)
    clipped_ratio = torch.exp(b.level_mean(clipped))
    per_token = -b.advantages * clipped_ratio
    changed = (sign != 0) & (clipped.detach() != token_log_ratio.detach())
    bias = b.aggregate(b.ratio * b.advantages) + b.aggregate(per_token)
    return _finish(b, per_token, changed, bias, ref_logprobs, entropy)


def _dppo(kind: str, logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, ref_logprobs, entropy,
          global_num_tokens, global_num_seqs, token_weights):
    """DPPO: drop a token whose (segment's) probability moved past the divergence threshold in its advantage's
    direction; the rest get L_t = -sg(min(rho_t, is_cap)) A_t log pi(y_t). At turn / sequence level the probabilities
    are the segment's geometric means exp(mean log pi)."""
    b = _batch(logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, global_num_tokens, global_num_seqs,
               token_weights)
    with torch.no_grad():
        new_log, old_log = b.level_mean(logprobs.detach()), b.level_mean(old_logprobs)
        new_p, old_p = torch.exp(new_log), torch.exp(old_log)
        if kind == "tv":
            keep_positive = new_p - old_p <= config.clip_high
            keep_negative = new_p - old_p >= -config.clip_low
        else:
            binary_kl = old_p * (old_log - new_log) + (1 - old_p) * torch.log((1 - old_p + 1e-8) / (1 - new_p + 1e-8))
            keep_positive = (binary_kl <= config.clip_high) | (new_p <= old_p)
            keep_negative = (binary_kl <= config.clip_low) | (new_p >= old_p)
        valid = torch.where(b.advantages > 0, keep_positive, keep_negative) & b.loss_mask
        weight = b.ratio.detach().clamp(max=config.is_cap) * valid
    per_token = -weight * b.advantages * b.masked(logprobs)
    changed = ~valid | (b.ratio.detach() > config.is_cap)
    return _finish(b, per_token, changed, _removed_share_bias(b, weight), ref_logprobs, entropy)


@register_policy_loss("dppo_tv", reads=("clip_low", "clip_high", "is_cap"))
def dppo_tv_loss(*, logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, ref_logprobs=None,
                 entropy=None, global_num_tokens=None, global_num_seqs=None, token_weights=None):
    """DPPO-Binary-TV: keep A > 0 while p - p_old <= eps_high, A <= 0 while p - p_old >= -eps_low."""
    return _dppo("tv", logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, ref_logprobs, entropy,
                 global_num_tokens, global_num_seqs, token_weights)


@register_policy_loss("dppo_kl", reads=("clip_low", "clip_high", "is_cap"))
def dppo_kl_loss(*, logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, ref_logprobs=None,
                 entropy=None, global_num_tokens=None, global_num_seqs=None, token_weights=None):
    """DPPO-Binary-KL: keep A > 0 while KL(Bern(p_old) || Bern(p)) <= eps_high or p <= p_old; A <= 0 while it is
    <= eps_low or p >= p_old."""
    return _dppo("kl", logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, ref_logprobs, entropy,
                 global_num_tokens, global_num_seqs, token_weights)


@register_policy_loss("m2po", reads=("ratio_level", "m2_threshold"))
def m2po_loss(*, logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, ref_logprobs=None, entropy=None,
              global_num_tokens=None, global_num_seqs=None, token_weights=None, keep=None, second_moment=None):
    """M2PO: L_t = -M_t rho_t A_t, no clipping; M drops the segments with the largest squared log-ratio until the
    second moment of the rest, over the batch of every rank, is below m2_threshold (second_moment.py).

    ``keep`` / ``second_moment``: M and the statistic already taken over a larger batch than the one given (the
    trainer's whole optimizer batch, :func:`m2po_whole_batch`), or on another pair of policies (the decoupled
    objective's proximal against behaviour); without them, the current policy against ``old_logprobs`` over the
    batch given."""
    b = _batch(logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, global_num_tokens, global_num_seqs,
               token_weights)
    if keep is None:
        keep, second_moment = m2po_keep_mask(b.log_ratio.detach(), b.loss_mask, turn_ids, config.ratio_level,
                                             config.m2_threshold)
    keep = keep & b.loss_mask
    per_token = -keep.to(b.ratio.dtype) * b.ratio * b.advantages
    changed = b.loss_mask & ~keep
    bias = b.aggregate(changed.to(b.ratio.dtype) * b.ratio * b.advantages)
    loss, bias, metrics = _finish(b, per_token, changed, bias, ref_logprobs, entropy)
    metrics.extreme("m2po/second_moment", second_moment.to(b.ratio.dtype), "max")  # the same on every rank
    return loss, bias, metrics


@register_whole_batch_statistic("m2po")
def m2po_whole_batch(*, logprobs, old_logprobs, loss_mask, turn_ids, config) -> list[dict]:
    """M2PO's mask over every micro-batch of the optimizer batch (and every rank): the ``keep`` and
    ``second_moment`` keywords of each micro-batch's :func:`m2po_loss` call, cut on the level log-ratio (clamped)
    of ``logprobs`` against ``old_logprobs``. Given the current policy's log-probs with the step's starting weights,
    the cut is the one the loss would make on the whole batch; under the decoupled objective the trainer gives the
    proximal policy's against the behaviour policy's (AReaL's pair, the one whose gap the lag opens)."""
    ratios = [_level_log_ratio(current.detach(), old, mask, turns, config.ratio_level)[0]
              for current, old, mask, turns in zip(logprobs, old_logprobs, loss_mask, turn_ids)]
    masks, second_moment = m2po_keep_masks(ratios, loss_mask, turn_ids, config.ratio_level, config.m2_threshold)
    return [{"keep": keep, "second_moment": second_moment} for keep in masks]
