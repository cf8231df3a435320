"""Rollout-training mismatch correction (docs/algorithms.md, "Rollout correction").

The policy that sampled a batch (vLLM, or transformers generate in another dtype or batch shape) is not exactly
the policy that scores it for training. With pi_old the trainer's pre-update log-probs and pi_s the sampler's
(``sample_logprobs``, kept at sampling time), the per-token log-weight is

    l_t = log pi_old(y_t) - log pi_s(y_t)

taken at ``rollout_correction_level``: per token, or its mean over the token's turn (a geometric mean of the
token weights, like ST-PPO's turn ratio) or over the whole trajectory. With w = exp(l):

    tis (truncated importance sampling):  w' = min(w, cap)
    mis (masked importance sampling):     w' = w if w <= cap else 0

w' is a constant (no gradient) multiplying each token's term of the policy loss: every rule takes it as its
``token_weights`` keyword (:func:`~stppo_agent.algorithms.losses.policy_token_mask`), so it also acts per token in
rules whose loss is not a sum of per-token terms (a turn- or sequence-level ratio, GMPO's geometric mean). A token
of weight 0 (mis above the cap) is dropped as if it had never been sampled: out of its segment's ratio, the
aggregation's count and the KL / entropy terms. The KL and entropy terms are not weighted otherwise (as in verl);
the clip-bias correction's clipped-token terms carry w' too.
"""

from __future__ import annotations

import dataclasses

import torch

from .losses import KL_LOG_RATIO_CLAMP, log_ratio_at_level
from .segments import masked_mean, quantile

AUTO_FIELDS = ("rollout_correction", "rollout_correction_level")
"""The algorithm fields whose ``auto`` depends on the run's settings (backend, sampler precision, objective)."""


def resolve_rollout_correction(algo, generation_backend: str, generation_autocast_dtype: str | None = None,
                               decoupled: bool = False):
    """``auto`` settings for a run: on with vLLM or a bfloat16 sampler (TIS at the cap of 2, at turn level for
    turn-level algorithms, else per token), off with transformers generate computing as the learner (the mismatch
    is only numerical there). ``decoupled`` (the decoupled objective under a rollout lag): MIS per token for every
    rule -- the behaviour weight pi_prox / pi_behav of decoupled PPO, so that rules differ only in their rule."""
    correction, level = algo.rollout_correction, algo.rollout_correction_level
    if correction == "auto":
        correction = "mis" if decoupled else "tis" if generation_backend == "vllm" or generation_autocast_dtype \
            else "none"
    if level == "auto":
        level = "turn" if algo.ratio_level == "turn" and not decoupled else "token"
    return dataclasses.replace(algo, rollout_correction=correction, rollout_correction_level=level)


def recorded_algorithm(requested: dict, resolved) -> tuple[dict, dict]:
    """What a run's config.yaml records of its algorithm: ``algorithm``, every field of ``resolved`` but those the
    user left to ``auto`` in ``requested`` (the preset's fields with the user's overrides), which stay ``auto`` so
    that a resume or a replay under other settings resolves them again; and ``algorithm_resolved``, what those
    resolved to for this run."""
    algorithm = {k: v for k, v in dataclasses.asdict(resolved).items() if k not in ("name", "hyperparameters")}
    algorithm.update(resolved.hyperparameters)  # a rule's own hyper-parameters, as --set algorithm.NAME spells them
    automatic = [field for field in AUTO_FIELDS if requested.get(field) == "auto"]
    algorithm.update({field: "auto" for field in automatic})
    return algorithm, {field: getattr(resolved, field) for field in automatic}


@torch.no_grad()
def rollout_correction_weights(old_logprobs: torch.Tensor, sample_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                               turn_ids: torch.Tensor, config) -> tuple[torch.Tensor | None, dict[str, float]]:
    """(weights w' (B, T), 0 off the mask; None when the correction is off) and the mismatch metrics, which are
    measured whether or not the correction is on: ``rollout_logprob_diff`` (mean |old - sample| per policy
    token), ``rollout_correction/kl`` (k3 estimate of KL(pi_s || pi_old)
    per policy token), ``weight_mean``/``weight_max``/``weight_p99`` of w before the cap, and with a correction
    ``truncated_frac`` (tis) or ``masked_frac`` (mis): the share of policy tokens whose w exceeded the cap."""
    if config.rollout_correction == "auto" or config.rollout_correction_level == "auto":
        raise ValueError("rollout_correction is 'auto': resolve it for the generation backend first "
                         "(resolve_rollout_correction)")
    if not bool(loss_mask.any()):  # weights whenever the correction is on: every rank's share has them or none
        off = config.rollout_correction == "none"
        return (None if off else torch.zeros_like(old_logprobs, dtype=torch.float32)), {}
    old, sample = old_logprobs.float(), sample_logprobs.float()
    zero = torch.zeros((), device=old.device)
    token_log_w = torch.where(loss_mask, old - sample, zero).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    level = config.rollout_correction_level
    log_w = log_ratio_at_level(old, sample, loss_mask, turn_ids, level) if level != "token" else token_log_w
    weight = torch.exp(log_w.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP))
    values = weight[loss_mask]
    metrics = {
        "rollout_logprob_diff": float(masked_mean((old - sample).abs(), loss_mask)),
        "rollout_correction/kl": float(masked_mean(torch.expm1(token_log_w) - token_log_w, loss_mask)),
        "rollout_correction/weight_mean": float(values.mean()),
        "rollout_correction/weight_max": float(values.max()),
        "rollout_correction/weight_p99": quantile(values, 0.99),
    }
    if config.rollout_correction == "none":
        return None, metrics
    above = weight > config.rollout_correction_cap
    if config.rollout_correction == "tis":
        weight = weight.clamp(max=config.rollout_correction_cap)
        metrics["rollout_correction/truncated_frac"] = float(masked_mean(above.float(), loss_mask))
    else:
        weight = torch.where(above, zero, weight)
        metrics["rollout_correction/masked_frac"] = float(masked_mean(above.float(), loss_mask))
    return torch.where(loss_mask, weight, zero), metrics
