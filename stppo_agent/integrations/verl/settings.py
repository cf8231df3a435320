"""A preset's settings as verl command-line overrides: the loss ``stppo_<preset>`` carries only the policy-loss part
of a preset (ratio level, its own loss function); the clip range, the aggregation, the KL and entropy terms and the
advantage estimator are verl settings, which :func:`verl_overrides` fills from the preset.

    python -m verl.trainer.main_ppo $(python -m stppo_agent.integrations.verl.settings turn_ppo) ...

Not mapped: the preset's rollout correction (``rollout_correction*``: verl's ``algorithm.rollout_correction`` is
set on its own), and this project's ``k3`` KL estimator becomes verl's ``k3``, which verl clamps to [-10, 10] like
``low_var_kl``.

Presets with the clip-bias correction (S-PPO, ST-PPO, SO-GRPO) and the turn-level presets (Turn-PPO) also select the
``stppo`` training engine: the correction lives there, and so does the hand-over of the agent loops' turn record
to the loss (:mod:`.turns`). verl picks engines by ``VERL_ENGINE_VENDOR`` in each worker's environment, which Ray's
runtime environment carries to every worker on every node, and the engine is registered for FSDP2 (docs/verl.md,
"The stppo engine").

Works without verl.
"""

from __future__ import annotations

import argparse
import sys

from stppo_agent.algorithms import ALGORITHMS, AlgorithmConfig

ACTOR = "actor_rollout_ref.actor"
ENGINE_OVERRIDES = [  # what selects the stppo engine (stppo_agent/integrations/verl/engine.py) in every worker
    "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR=stppo",
    f"{ACTOR}.strategy=fsdp2",  # the reference model follows the actor's strategy
]
VERL_ESTIMATORS = {"gae": "gae", "grpo": "grpo", "rloo": "rloo"}  # ours -> verl's (same definitions)
VERL_KL = {"k1": "k1", "k2": "k2", "k3": "k3", "low_var_kl": "low_var_kl"}  # verl's k3 is clamped like low_var_kl


class NotInVerlError(ValueError):
    """A preset setting that verl's trainer has no place for."""


def not_in_verl(preset: AlgorithmConfig) -> str | None:
    """Why verl cannot train ``preset`` (None: it can), in words that say what to use instead."""
    if preset.advantage not in VERL_ESTIMATORS:
        return (f"advantage estimator {preset.advantage!r} has no verl counterpart (verl passes the critic's values "
                "to its built-in GAE only, so a per-turn GAE cannot be registered); use stppo_turn_ppo with "
                "algorithm.adv_estimator=gae, or this project's own trainer")
    if preset.dynamic_sampling:
        return ("dynamic sampling is a trainer loop, not a loss (verl has its own as algorithm.filter_groups, in its "
                f"v1 trainer); use stppo_ppo with clip_ratio_low={preset.clip_low} clip_ratio_high={preset.clip_high}"
                " and verl's filter_groups, or this project's own trainer")
    return None


def verl_overrides(name: str) -> list[str]:
    """Hydra overrides for ``verl.trainer.main_ppo`` that select preset ``name`` with its defaults."""
    preset = ALGORITHMS[name]
    reason = not_in_verl(preset)
    if reason is not None:
        raise NotInVerlError(f"preset {name}: {reason} (docs/verl.md)")
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
    if needs_engine(preset):
        overrides += ENGINE_OVERRIDES
    return overrides


def needs_engine(preset: AlgorithmConfig) -> bool:
    """The clip-bias correction lives in the stppo engine; a turn-level ratio needs the turn record it hands over."""
    return preset.clip_bias_correction or preset.ratio_level == "turn"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stppo_agent.integrations.verl.settings",
                                     description="print a preset's settings as verl.trainer.main_ppo overrides")
    parser.add_argument("preset", choices=sorted(ALGORITHMS), metavar="PRESET",
                        help=f"one of: {', '.join(sorted(ALGORITHMS))}")
    args = parser.parse_args(argv)
    try:
        print(" ".join(verl_overrides(args.preset)))
    except NotInVerlError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
