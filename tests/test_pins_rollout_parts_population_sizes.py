"""``rollout_parts``' population sizes: per-trajectory means times the share's trajectories, and none for a
statistic a batch recorded before it existed (no turns, no observations: it weighs nothing in the ranks' means)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from stppo_agent.rollouts.statistics import rollout_parts


def _share(**stats) -> SimpleNamespace:
    return SimpleNamespace(stats=stats, batch_size=4, loss_mask=torch.ones(4, 3, dtype=torch.bool), old_logprobs=None)


def test_turns_and_observations_are_totals_and_zero_when_unrecorded():
    parts = rollout_parts(_share(turns=2.5, observations=1.5), None)
    assert parts["trajectories"] == 4.0 and parts["policy_tokens"] == 12.0
    assert parts["turns"] == 10.0 and parts["observations"] == 6.0
    old = rollout_parts(_share(), None)
    assert old["turns"] == 0.0 and old["observations"] == 0.0 and old["searches"] == 0.0
