"""Pins of stppo_agent/training/ppo_update.py's update(): a step the critic skipped keeps the actor's finite
metrics in the iteration's means (only the skip flag and the non-finite values leave), and the skip count is
steps, not a mean of flags."""

from __future__ import annotations

import math

from .test_pins_training import make_batch, update_stage


def test_a_critic_only_skip_keeps_the_actors_metrics_and_drops_the_non_finite_ones():

    t = update_stage(seed=3, critic=True, optimizer=dict(epochs=1, mini_batch_size=4, micro_batch_size=2),
                     monitor=dict(max_nan_skips=100))
    batch = make_batch()
    batch.returns[:, 0] = math.inf  # every step's critic fails, every actor step applies
    steps = math.ceil(batch.batch_size / 4)
    metrics = t.update(batch)
    assert t.state.optimizer_steps == steps and t.state.nan_skips_total == steps
    assert metrics["skipped"] == steps
    assert math.isfinite(metrics["pg_loss"]) and math.isfinite(metrics["grad_norm"])  # the actor's, kept
    assert "critic_grad_norm" not in metrics  # inf in every step: dropped, not averaged into inf
