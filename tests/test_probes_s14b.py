"""Session 14 skeptic probes, training side: settings a user picks that silently corrupted training."""

from __future__ import annotations

import math

import pytest

from .test_pins_training import fake_trainer, make_batch


# -- max_nan_skips counts optimizer steps (mini-batches), whichever model's half was non-finite --------------------

def _poisoned(actor: bool, critic: bool):
    mini = make_batch().select([0, 1, 2, 3])
    if actor:
        mini.advantages[0, 0] = math.nan
    if critic:
        mini.returns[1, 0] = math.inf
    return mini


def test_a_step_whose_actor_and_critic_both_fail_counts_once_toward_max_nan_skips():
    from stppo_agent.training.ppo_update import PPOUpdate, TrainingDivergedError

    t = fake_trainer(max_nan_skips=2)
    updater = PPOUpdate(t)
    for expected in (1, 2):  # max_nan_skips=2: two consecutive skipped updates are tolerated
        out = updater._optimizer_step(_poisoned(actor=True, critic=True))
        assert out["skipped"] == 1.0 and t.nan_skips_in_a_row == expected and t.nan_skips_total == expected
    with pytest.raises(TrainingDivergedError, match="^3 consecutive updates"):
        updater._optimizer_step(_poisoned(actor=True, critic=True))
    assert t.reports[0] == "iteration 1: non-finite actor and critic loss or gradient; update skipped (1 in a row)"


def test_a_critic_that_fails_every_step_stops_the_run_though_the_actor_steps():
    from stppo_agent.training.ppo_update import PPOUpdate, TrainingDivergedError

    t = fake_trainer(max_nan_skips=1)
    updater = PPOUpdate(t)
    out = updater._optimizer_step(_poisoned(actor=False, critic=True))
    assert out["skipped"] == 1.0 and t.optimizer_steps == 1 and t.nan_skips_in_a_row == 1
    with pytest.raises(TrainingDivergedError, match="^2 consecutive updates"):
        updater._optimizer_step(_poisoned(actor=False, critic=True))
    assert t.optimizer_steps == 2  # the actor kept stepping: only the counter stopped the run


def test_a_clean_step_after_a_skipped_one_resets_the_count():
    from stppo_agent.training.ppo_update import PPOUpdate

    t = fake_trainer(max_nan_skips=1)
    updater = PPOUpdate(t)
    updater._optimizer_step(_poisoned(actor=False, critic=True))
    assert "skipped" not in updater._optimizer_step(_poisoned(actor=False, critic=False))
    assert t.nan_skips_in_a_row == 0 and t.nan_skips_total == 1
