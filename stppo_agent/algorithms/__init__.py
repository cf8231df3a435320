"""The math of the PPO family (docs/algorithms.md): advantage estimators, policy/critic losses, presets. Tensor
functions; the clip-bias correction and M2PO's second moment also reduce over data-parallel ranks when there are
several.

    from stppo_agent.algorithms import ALGORITHMS, get_advantage_estimator, get_policy_loss

    preset = ALGORITHMS["st_ppo"]
    advantages, returns = get_advantage_estimator(preset.advantage)(
        rewards=rewards, values=values, loss_mask=loss_mask, group_ids=group_ids, config=preset)
    loss, bias_surrogate, metrics = get_policy_loss(preset.policy_loss)(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
        loss_mask=loss_mask, turn_ids=turn_ids, config=preset)
    metrics.parts["turn_clip_frac"]   # Summed([turns outside the clip range, turns]): exact over micro-batches
"""

from . import stabilizers  # noqa: F401  (registers cispo, sapo, gmpo, dppo_tv, dppo_kl, m2po)
from .advantages import (
    ADVANTAGE_ESTIMATORS,
    compact_policy_positions,
    estimate_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
)
from .clip_bias import ClipBiasCorrector
from .config import ALGORITHMS, AlgorithmConfig, register_algorithm
from .dynamic_sampling import dropped_group_count, informative_groups
from .hyperparameters import Hyperparameter
from .losses import (
    POLICY_LOSSES,
    WHOLE_BATCH_STATISTICS,
    aggregate,
    aggregate_parts,
    call_policy_loss,
    explained_variance,
    get_policy_loss,
    kl_estimate,
    kl_reward_penalty,
    learner_kl_metrics,
    log_ratio_at_level,
    policy_token_mask,
    register_policy_loss,
    register_whole_batch_statistic,
    value_loss,
)
from .metrics import Extreme, LossMetrics, Summed
from .registry import Registry
from .rollout_correction import (
    AUTO_FIELDS,
    recorded_algorithm,
    resolve_rollout_correction,
    rollout_correction_weights,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "ALGORITHMS", "AUTO_FIELDS", "AlgorithmConfig", "ClipBiasCorrector", "Extreme",
    "Hyperparameter",
    "LossMetrics", "POLICY_LOSSES", "Registry", "Summed", "WHOLE_BATCH_STATISTICS", "aggregate", "aggregate_parts",
    "call_policy_loss", "compact_policy_positions",
    "dropped_group_count", "estimate_advantages", "explained_variance", "get_advantage_estimator",
    "informative_groups", "get_policy_loss", "kl_estimate", "kl_reward_penalty", "learner_kl_metrics",
    "log_ratio_at_level", "policy_token_mask", "recorded_algorithm", "register_advantage_estimator",
    "register_algorithm",
    "register_policy_loss", "register_whole_batch_statistic", "resolve_rollout_correction",
    "rollout_correction_weights", "value_loss",
]
