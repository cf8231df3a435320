"""A rollout batch that cannot teach anything: said once per run, with the likely cause and what to try.

An update learns from differences between trajectories. When every trajectory of a group earned the same reward,
a group-relative estimator (GRPO, RLOO) gives every token advantage 0; when every trajectory of the whole batch
earned the same reward, a critic can only learn that constant, and the policy's "advantages" are its own noise.
Either way the run spends minutes per iteration and the curves stay flat; the usual cause is a model that never
produces a rewarded action at the run's settings (a base model on a search env, two new tokens per turn).
"""

from __future__ import annotations

from typing import Callable

import torch

from stppo_agent.algorithms import AlgorithmConfig, informative_groups
from stppo_agent.distributed import process_group

TOLERANCE = 1e-6  # rewards closer than this are the same reward (float noise of shaped rewards)


def no_signal_reason(rewards: torch.Tensor, group_ids: torch.Tensor, advantages: torch.Tensor | None,
                     loss_mask: torch.Tensor, group_relative: bool) -> str | None:
    """Why this batch has no learning signal, or None if it has one. ``group_relative``: the advantage estimator
    compares a trajectory with its group only (so equal rewards within every group are enough to learn nothing)."""
    rewards = rewards.detach().float().cpu()
    if rewards.numel() and float(rewards.max() - rewards.min()) <= TOLERANCE:
        value = float(rewards[0])
        if abs(value) <= TOLERANCE:  # all -1 (a penalty every time) is not "reward 0"
            return "every trajectory's reward is 0"
        return f"every trajectory earned the same reward ({value:.3f})"
    if group_relative:
        if not bool(informative_groups(rewards, group_ids.detach().cpu(), tolerance=TOLERANCE).any()):
            return "within every group the trajectories earned the same reward (each prompt always or never paid)"
    if advantages is not None:
        mask = loss_mask.detach().cpu()
        if not mask.any() or bool((advantages.detach().cpu()[mask].abs() <= 1e-12).all()):
            return "every token's advantage is 0"
    return None


def advice(reason: str, config) -> str:
    """The notice: what was seen, the likely cause at the run's settings, and what to try."""
    rollout = config.rollout
    settings = (f"rollout.max_turns={rollout.max_turns}, rollout.max_new_tokens_per_turn="
                f"{rollout.max_new_tokens_per_turn}, rollout.temperature={rollout.temperature}, "
                f"rollout.samples_per_prompt={rollout.samples_per_prompt}")
    if reason.startswith("every trajectory earned the same reward"):
        cause = "the task is already solved (or always paid the same) at these settings"
        tries = "a harder dataset or split, or a reward that tells answers apart (--set env_kwargs.reward=f1)"
    else:
        from stppo_agent.rollouts.envs import is_search_env

        cause = "the model never (or always) produces a rewarded action at these settings"
        search = any(is_search_env(e.strip()) for e in config.env.split(",") if e.strip())
        tries = ", ".join(["longer turns (--set rollout.max_new_tokens_per_turn=...)",
                           "more samples (--set rollout.samples_per_prompt=...)",
                           *(["a shaped reward (--set env_kwargs.format_reward=0.2)", "a warm start (stppo sft)"]
                             if search else ["a model whose vocabulary holds the env's words (--model tiny on "
                                             "stppo/Toy-v0)"])])
    return (f"no learning signal: {reason}, so this update cannot learn the task. Likely cause: {cause} "
            f"({settings}). Try {tries}. (Said once; metrics.jsonl keeps the per-iteration figures.)")


class LearningSignalNotice:
    """Reports the first batch without learning signal, once per run: the likely cause at the run's settings
    (``config``, a TrainConfig) and what to try. With several processes every rank checks (one all-reduce, on
    ``device``) and rank 0 reports."""

    def __init__(self, config, algo: AlgorithmConfig, report: Callable[[str], None], world: int = 1,
                 device: torch.device = torch.device("cpu")):
        self.config, self.algo, self.report, self.world, self.device = config, algo, report, world, device
        self.reported = False

    def check(self, batch, iteration: int) -> None:
        """Call after scoring ``batch`` (advantages set) in iteration ``iteration`` (0-based)."""
        if self.reported:
            return
        from stppo_agent.algorithms.advantages import GROUP_ESTIMATORS

        reason = no_signal_reason(batch.rewards, batch.group_ids, batch.advantages, batch.loss_mask,
                                  self.algo.advantage in GROUP_ESTIMATORS)
        if self.world > 1:  # a signal on any rank is a signal of the global batch
            with_signal = process_group.all_reduce_sum(torch.tensor(float(reason is None), device=self.device))
            if float(with_signal) > 0:
                return
        if reason is None:
            return
        self.reported = True
        if process_group.is_main():
            self.report(f"iteration {iteration + 1}: {advice(reason, self.config)}")
