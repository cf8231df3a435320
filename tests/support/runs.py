"""Small training configs on ``stppo/Toy-v0`` and what a run's metrics records hold."""

from __future__ import annotations

from pathlib import Path

from stppo_agent.training.config import TrainConfig, from_dict, merged

TIMING = {"rollout_seconds", "iteration_seconds", "rollout_tokens_per_s", "update_tokens_per_s"}


def one_iteration_config(model: Path, out: Path, **overrides) -> TrainConfig:
    values = dict(algo="st_ppo", env="stppo/Toy-v0", model=str(model), output_dir=str(out), iterations=1,
                  algorithm={"kl_in_reward": 0.0, "kl_loss_coef": 0.1, "entropy_coef": 0.01},
                  rollout=dict(prompts_per_iteration=4, samples_per_prompt=2, max_turns=2, max_new_tokens_per_turn=2,
                               max_prompt_tokens=8, max_total_tokens=32),
                  optimizer=dict(epochs=1, mini_batch_size=8, micro_batch_size=2),
                  logging=dict(progress=False, tensorboard=False))
    values = merged(values, overrides)
    return from_dict(values)


# The trainer learns on the toy env, fails when the math is broken, survives kill -9, NaNs and corrupt files.


def toy_config(model: Path, out: Path, algo: str, **overrides) -> TrainConfig:
    values = dict(algo=algo, env="stppo/Toy-v0", model=str(model), output_dir=str(out), iterations=14,
                  algorithm={"kl_in_reward": 0.0, "kl_loss_coef": 0.0},
                  rollout=dict(prompts_per_iteration=8, samples_per_prompt=8, max_turns=2, max_new_tokens_per_turn=1,
                               max_prompt_tokens=8, max_total_tokens=32),
                  optimizer=dict(epochs=2, mini_batch_size=32, micro_batch_size=16, actor_lr=3e-3, critic_lr=3e-3),
                  logging=dict(progress=False, tensorboard=False), checkpoint=dict(every=100))
    values = merged(values, overrides)
    return from_dict(values)
