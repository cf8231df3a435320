"""A preset's settings as verl command-line overrides: the loss ``stppo_<preset>`` carries only the policy-loss part
of a preset (ratio level, its own loss function); the clip range, the aggregation, the KL and entropy terms and the
advantage estimator are verl settings, which :func:`verl_overrides` fills from the preset.

    python -m verl.trainer.main_ppo $(python -m stppo_agent.integrations.verl.settings turn_ppo) ...

Presets with the clip-bias correction (S-PPO, ST-PPO, SO-GRPO) also select the ``stppo`` training engine: verl
picks engines by ``VERL_ENGINE_VENDOR`` in each worker's environment, which Ray's runtime environment carries to
every worker on every node, and the engine is registered for FSDP2 (docs/verl.md, "The clip-bias engine").

Works without verl.
"""

from __future__ import annotations

import sys

from stppo_agent.algorithms import ALGORITHMS

ACTOR = "actor_rollout_ref.actor"
ENGINE_OVERRIDES = [  # what selects the stppo engine (stppo_agent/integrations/verl/engine.py) in every worker
    "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR=stppo",
    f"{ACTOR}.strategy=fsdp2",  # the reference model follows the actor's strategy
]
VERL_ESTIMATORS = {"gae": "gae", "grpo": "grpo", "rloo": "rloo"}  # ours -> verl's (same definitions)
VERL_KL = {"k1": "k1", "k2": "k2", "k3": "k3", "low_var_kl": "low_var_kl"}  # verl's k3 is clamped like low_var_kl


class NotInVerlError(ValueError):
    """A preset setting that verl's trainer has no place for."""


def verl_overrides(name: str) -> list[str]:
    """Hydra overrides for ``verl.trainer.main_ppo`` that select preset ``name`` with its defaults."""
    preset = ALGORITHMS[name]
    if preset.advantage not in VERL_ESTIMATORS:
        raise NotInVerlError(
            f"preset {name}: advantage estimator {preset.advantage!r} has no verl counterpart; verl passes the "
            "critic's values to its built-in GAE only, so a per-turn GAE cannot be registered (docs/verl.md)")
    if preset.dynamic_sampling:
        raise NotInVerlError(f"preset {name}: dynamic sampling is a recipe of verl's (recipe/dapo), not a setting "
                             "of verl.trainer.main_ppo")
    overrides = [
        f"{ACTOR}.policy_loss.loss_mode=stppo_{name}",
        f"{ACTOR}.clip_ratio_low={preset.clip_low}",
        f"{ACTOR}.clip_ratio_high={preset.clip_high}",
        f"{ACTOR}.loss_agg_mode={preset.loss_agg}",
        f"{ACTOR}.use_kl_loss={preset.kl_loss_coef > 0}",
        f"{ACTOR}.kl_loss_coef={preset.kl_loss_coef}",
        f"{ACTOR}.kl_loss_type={VERL_KL[preset.kl_estimator]}",
        f"{ACTOR}.entropy_coeff={preset.entropy_coef}",
        f"algorithm.adv_estimator={VERL_ESTIMATORS[preset.advantage]}",
        f"algorithm.gamma={preset.gamma}",
        f"algorithm.lam={preset.lam}",
        f"algorithm.norm_adv_by_std_in_grpo={preset.grpo_std_normalize}",
        f"algorithm.use_kl_in_reward={preset.kl_in_reward > 0}",
        f"algorithm.kl_ctrl.kl_coef={preset.kl_in_reward}",
    ]
    if preset.loss_agg == "seq-mean-token-sum-norm":
        overrides.append(f"{ACTOR}.loss_scale_factor={int(preset.loss_scale_factor)}")
    if preset.clip_bias_correction:
        overrides += ENGINE_OVERRIDES
    return overrides


if __name__ == "__main__":
    print(" ".join(verl_overrides(sys.argv[1])))
