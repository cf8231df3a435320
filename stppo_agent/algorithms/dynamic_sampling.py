"""DAPO's dynamic sampling, the part that is pure math (docs/algorithms.md, "DAPO").

A group whose trajectories all earned the same reward has group-relative advantage 0 everywhere: it costs a
forward and backward pass and teaches nothing, and it shrinks the effective batch. DAPO drops such groups and
samples more prompts until the batch is full again (at most ``max_resample_rounds`` extra rounds). The rollout
collection does the sampling; it asks :func:`informative_groups` which trajectories to keep and logs how many
groups were dropped.
"""

from __future__ import annotations

import torch


def informative_groups(rewards: torch.Tensor, group_ids: torch.Tensor, tolerance: float = 0.0) -> torch.Tensor:
    """(B,) bool: True for the trajectories of groups whose rewards are not all equal (spread above ``tolerance``).
    A group of one has no spread either and is dropped too (its advantage is 0 under every group estimator here)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    rewards = rewards.to(torch.float64)
    highest = torch.full((groups,), -torch.inf, dtype=torch.float64, device=rewards.device).scatter_reduce(
        0, inverse, rewards, "amax")
    lowest = torch.full((groups,), torch.inf, dtype=torch.float64, device=rewards.device).scatter_reduce(
        0, inverse, rewards, "amin")
    return (highest - lowest > tolerance)[inverse]


def dropped_group_count(keep: torch.Tensor, group_ids: torch.Tensor) -> int:
    """How many groups :func:`informative_groups` dropped (the metric DAPO's sampling logs)."""
    return int(torch.unique(group_ids[~keep]).numel())
