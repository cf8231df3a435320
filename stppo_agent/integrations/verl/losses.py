"""Every algorithm preset of :data:`stppo_agent.algorithms.ALGORITHMS` as a verl policy loss ``stppo_<preset>``.

verl looks a policy loss up by ``actor_rollout_ref.actor.policy_loss.loss_mode`` on every call of
``verl/workers/utils/losses.py::ppo_loss``, which passes ``old_log_prob, log_prob, advantages, response_mask (bool),
loss_agg_mode, config (ActorConfig), rollout_is_weights`` and adds verl's own entropy and KL terms afterwards. So a
preset contributes its policy-loss part only -- the ratio level (token, turn, sequence) and whether it needs the
clip-bias correction; the advantage estimator, the KL and entropy terms and the clip range are verl's settings
(``algorithm.adv_estimator``, ``actor.use_kl_loss``, ``actor.entropy_coeff``, ``actor.clip_ratio_low/high``).

Turn ids come from the turn record of the bridge's agent loops, which the ``stppo`` engine hands to the loss per
micro-batch (:mod:`.turns`); without it (verl's own engine, another agent loop) each maximal run of 1s of the
response mask is read as one assistant turn, which verl's token-level rollout rejection can split. Presets that verl
cannot train (a per-turn GAE, dynamic sampling: :func:`.settings.not_in_verl`) are registered too, and refuse at
their first call with what to use instead.

Presets whose policy loss is ``ppo_clip`` (all built-in ones) follow ``compute_policy_loss_vanilla``'s arithmetic
op for op, with the log-ratio taken at the preset's level and without dual clipping: ``stppo_ppo`` is verl's
``vanilla`` with ``clip_ratio_c`` out of reach, to the bit. Other policy losses (registered by a user) are called
through this project's own interface. S-PPO / ST-PPO / SO-GRPO need the clip-bias correction, which lives in a
training engine (not in a loss): their loss is the same clipped surrogate, and it hands its bias surrogate
``agg(c_t * rho_t * A_t)`` to the ``stppo`` engine (:mod:`.engine`, :mod:`.correction`); without that engine it
raises :class:`ClipBiasEngineMissingError` at the first actor update instead of silently training Turn-PPO.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss, register_policy_loss
from verl.utils.torch_functional import masked_mean

from stppo_agent.algorithms import ALGORITHMS, AlgorithmConfig, get_policy_loss, log_ratio_at_level
from stppo_agent.algorithms.config import LOSS_AGG_NAMES

from . import correction, turns
from .correction import ClipBiasEngineMissingError  # noqa: F401  (part of this module's interface)
from .settings import NotInVerlError, not_in_verl
from .turns import turn_ids_from_mask  # noqa: F401  (part of this module's interface)

LOSS_PREFIX = "stppo_"
LOG_RATIO_CLAMP = 20.0  # verl's clamp of log(pi / pi_old) before exp
OUR_AGG_MODES = LOSS_AGG_NAMES  # the aggregations this project's own losses know
EXTRA_METRICS = ("turn_clip_frac", "ratio/mean", "ratio/max", "ratio/min", "approx_kl")


def clip_range(config) -> tuple[float, float]:
    """(eps_low, eps_high) as verl's vanilla loss reads them from the actor config."""
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return low, high


def verl_policy_loss(preset: AlgorithmConfig):
    """A function with verl's policy-loss signature that applies ``preset``'s policy loss."""
    return functools.partial(_policy_loss, preset)


def register_verl_losses(presets=ALGORITHMS) -> list[str]:
    """Register ``stppo_<name>`` for every preset not registered yet; returns the names added. Idempotent: a
    plugin that registers presets of its own calls it again afterwards."""
    added = []
    for name, preset in presets.items():
        loss_name = LOSS_PREFIX + name
        if loss_name not in POLICY_LOSS_REGISTRY:
            register_policy_loss(loss_name)(verl_policy_loss(preset))
            added.append(loss_name)
    return added


def _policy_loss(preset: AlgorithmConfig, old_log_prob, log_prob, advantages, response_mask,
                 loss_agg_mode: str = "token-mean", config=None, rollout_is_weights=None):
    if config is None:
        raise ValueError(f"stppo_{preset.name} needs verl's actor config (clip range, global batch info)")
    refusal = not_in_verl(preset)
    if refusal is not None:
        raise NotInVerlError(f"policy loss stppo_{preset.name}: {refusal} (docs/verl.md)")
    mask = response_mask.bool()
    turn_ids = turns.turn_ids(mask, f"stppo_{preset.name}", warn=preset.ratio_level == "turn")
    low, high = clip_range(config)
    if preset.policy_loss == "ppo_clip":
        pg_loss, bias, metrics = _clipped_surrogate(preset.ratio_level, old_log_prob, log_prob, advantages, mask,
                                                    turn_ids, low, high, loss_agg_mode, config.global_batch_info,
                                                    rollout_is_weights)
        ours = _our_loss(preset, old_log_prob, log_prob.detach(), advantages, mask, turn_ids, low, high,
                         loss_agg_mode if loss_agg_mode in OUR_AGG_MODES else "token-mean",
                         _scale(config.global_batch_info, mask))[2]
    else:
        pg_loss, bias, ours = _registered_loss(preset, old_log_prob, log_prob, advantages, mask, turn_ids, low, high,
                                         loss_agg_mode, config.global_batch_info, rollout_is_weights)
        metrics = {"actor/pg_clipfrac": float(ours["clip_frac"]),
                   "actor/ppo_kl": float(masked_mean(-_clamped(log_prob - old_log_prob), mask).detach())}
    metrics.update({f"actor/stppo/{key}": float(ours[key]) for key in EXTRA_METRICS if key in ours})
    if preset.clip_bias_correction:
        correction.offer(preset.name, preset.ratio_level, bias, log_prob)
    return pg_loss, metrics


def _clamped(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_ratio, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def _clipped_surrogate(level, old_log_prob, log_prob, advantages, mask, turn_ids, low, high, loss_agg_mode,
                       global_batch_info, rollout_is_weights):
    """``compute_policy_loss_vanilla`` without dual clipping, its log-ratio at ``level`` (same ops, same order), and
    the bias surrogate ``agg(c_t * rho_t * A_t)`` (c_t: the clipped branch is strictly smaller; rollout weights carry
    over), detached when nothing is clipped, as this project's ``ppo_clip`` returns it."""
    token_log_ratio = _clamped(log_prob - old_log_prob)
    if level == "token":
        negative_approx_kl = token_log_ratio
    else:
        negative_approx_kl = _clamped(log_ratio_at_level(log_prob, old_log_prob, mask, turn_ids, level))
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), mask)
    ppo_kl = masked_mean(-token_log_ratio, mask)
    clipped = mask & (((advantages > 0) & (ratio > 1 + high)) | ((advantages < 0) & (ratio < 1 - low)))
    bias_terms = torch.where(clipped, ratio * advantages, torch.zeros_like(ratio))
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
        bias_terms = bias_terms * rollout_is_weights
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=mask, loss_agg_mode=loss_agg_mode, **global_batch_info)
    bias = agg_loss(loss_mat=bias_terms, loss_mask=mask, loss_agg_mode=loss_agg_mode, **global_batch_info)
    if not bool(clipped.any()):
        bias = bias.detach()
    return pg_loss, bias, {"actor/pg_clipfrac": pg_clipfrac.detach().item(), "actor/ppo_kl": ppo_kl.detach().item()}


def _scale(global_batch_info, mask) -> float:
    """verl's seq-mean-token-sum-norm divisor: ``loss_scale_factor``, else the padded response length."""
    factor = global_batch_info.get("loss_scale_factor")
    return float(factor if factor is not None else mask.shape[-1])


def _our_loss(preset, old_log_prob, log_prob, advantages, mask, turn_ids, low, high, agg, scale, **global_counts):
    config = dataclasses.replace(preset, clip_low=low, clip_high=high, loss_agg=agg, loss_scale_factor=scale)
    return get_policy_loss(preset.policy_loss)(
        logprobs=log_prob, old_logprobs=old_log_prob, advantages=advantages, loss_mask=mask, turn_ids=turn_ids,
        config=config, **global_counts)


def _registered_loss(preset, old_log_prob, log_prob, advantages, mask, turn_ids, low, high, loss_agg_mode,
                     global_batch_info, rollout_is_weights):
    """A user-registered policy loss, with verl's global normalisation translated to this project's: verl divides a
    micro-batch's sum by the global count and multiplies by dp_size (DDP then averages over ranks); ours divides by
    the count per rank. Rollout weights scale the advantages, as this project's trainer applies them."""
    if loss_agg_mode not in OUR_AGG_MODES:
        raise ValueError(f"policy loss stppo_{preset.name} ({preset.policy_loss}) supports loss_agg_mode "
                         f"{', '.join(OUR_AGG_MODES)}, not {loss_agg_mode!r}")
    dp_size = global_batch_info.get("dp_size", 1) or 1
    tokens, seqs = global_batch_info.get("batch_num_tokens"), global_batch_info.get("global_batch_size")
    counts = {"global_num_tokens": None if tokens is None else tokens / dp_size,
              "global_num_seqs": None if seqs is None else seqs / dp_size}
    if rollout_is_weights is not None:
        advantages = advantages * rollout_is_weights
    return _our_loss(preset, old_log_prob, log_prob, advantages, mask, turn_ids, low, high, loss_agg_mode,
                     _scale(global_batch_info, mask), **counts)
