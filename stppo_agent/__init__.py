"""stppo_agent: train and evaluate LLM policies on stppo_envs with PPO-family algorithms (ST-PPO and friends)."""

__version__ = "0.1.0"
