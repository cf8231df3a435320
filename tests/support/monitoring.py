"""The collapse monitor's config of the monitoring tests."""

from __future__ import annotations

from stppo_agent.training.config import TrainConfig
from stppo_agent.training.config_sections import RolloutConfig


def config(env: str = "stppo/Toy-v0") -> TrainConfig:
    return TrainConfig(env=env,
                       rollout=RolloutConfig(max_turns=3, max_new_tokens_per_turn=4, temperature=0.7,
                                             samples_per_prompt=5))
