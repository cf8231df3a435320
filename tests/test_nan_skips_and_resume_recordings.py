"""NaN-skipped steps counted and logged right, and resume dropping recordings the checkpoint did not train on
(session 14 skeptic probes: settings a user picks that silently corrupted training)."""

from __future__ import annotations

import math

import pytest

from .test_pins_training import make_batch, update_stage

# -- max_nan_skips counts optimizer steps (mini-batches), whichever model's half was non-finite --------------------

def _poisoned(actor: bool, critic: bool):
    mini = make_batch().select([0, 1, 2, 3])
    if actor:
        mini.advantages[0, 0] = math.nan
    if critic:
        mini.returns[1, 0] = math.inf
    return mini


def test_a_step_whose_actor_and_critic_both_fail_counts_once_toward_max_nan_skips():
    from stppo_agent.training.ppo_update import TrainingDivergedError

    t = update_stage(monitor=dict(max_nan_skips=2))
    updater = t
    for expected in (1, 2):  # max_nan_skips=2: two consecutive skipped updates are tolerated
        out = updater._optimizer_step(_poisoned(actor=True, critic=True))
        assert out["skipped"] == 1.0 and t.state.nan_skips_in_a_row == expected and t.state.nan_skips_total == expected
    with pytest.raises(TrainingDivergedError, match="^3 consecutive updates"):
        updater._optimizer_step(_poisoned(actor=True, critic=True))
    assert t.report[0] == "iteration 1: non-finite actor and critic loss or gradient; update skipped (1 in a row)"


def test_a_critic_that_fails_every_step_stops_the_run_though_the_actor_steps():
    from stppo_agent.training.ppo_update import TrainingDivergedError

    t = update_stage(monitor=dict(max_nan_skips=1))
    updater = t
    out = updater._optimizer_step(_poisoned(actor=False, critic=True))
    assert out["skipped"] == 1.0 and t.state.optimizer_steps == 1 and t.state.nan_skips_in_a_row == 1
    with pytest.raises(TrainingDivergedError, match="^2 consecutive updates"):
        updater._optimizer_step(_poisoned(actor=False, critic=True))
    assert t.state.optimizer_steps == 2  # the actor kept stepping: only the counter stopped the run


def test_a_clean_step_after_a_skipped_one_resets_the_count():

    t = update_stage(monitor=dict(max_nan_skips=1))
    updater = t
    updater._optimizer_step(_poisoned(actor=False, critic=True))
    assert "skipped" not in updater._optimizer_step(_poisoned(actor=False, critic=False))
    assert t.state.nan_skips_in_a_row == 0 and t.state.nan_skips_total == 1


# -- a resumed run's recording holds its own iterations only ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


@pytest.mark.parametrize("still_recording", [True, False])
def test_resume_drops_the_recorded_iterations_the_checkpoint_did_not_train_on(tiny_model, tmp_path, still_recording):
    """Killed after recording iterations 3 and 4 but before checkpoint step-4, then resumed from step-2 for
    iterations=3: the recording of iteration 4 came from the dead run, and a replay (which replays every recorded
    iteration) trained on a batch this run never saw."""
    import shutil

    from stppo_agent.runs.recording import recorded_iterations
    from stppo_agent.training.replay import replay_config
    from stppo_agent.training.trainer import Trainer

    from .test_trainer import toy_config

    small = dict(rollout=dict(prompts_per_iteration=2, samples_per_prompt=2),
                 optimizer=dict(mini_batch_size=4, micro_batch_size=4, epochs=1), checkpoint=dict(every=2, keep=3),
                 logging=dict(save_rollouts=True), monitor=dict(on_collapse="none"))
    Trainer(toy_config(tiny_model, tmp_path, "grpo", iterations=4, **small)).train()
    shutil.rmtree(tmp_path / "checkpoints" / "step-4")  # the kill came before iteration 4's checkpoint
    assert recorded_iterations(tmp_path / "rollouts", 0) == [1, 2, 3, 4]
    resumed = toy_config(tiny_model, tmp_path, "grpo", iterations=3,
                         **dict(small, logging=dict(save_rollouts=still_recording)))
    Trainer(resumed, resume=True, report=lambda _: None).train()
    kept = [1, 2, 3] if still_recording else [1, 2]  # not recording: the dead run's iteration 3 goes too
    assert recorded_iterations(tmp_path / "rollouts", 0) == kept
    assert not list((tmp_path / "rollouts").glob("iter-000004.*"))
    assert replay_config(tmp_path, None, str(tmp_path / "replay")).iterations == len(kept)


# -- a skipped (non-finite) step neither blinds the collapse monitor nor passes for healthy -------------------------

def test_an_iteration_with_a_skipped_step_logs_the_applied_steps_means_and_how_many_were_skipped():
    """One of the iteration's steps is non-finite and skipped: the iteration's means were NaN (grad_norm, pg_loss,
    ...), which the collapse monitor ignores, so the iteration where the trouble began was judged on nothing."""

    t = update_stage(seed=3, critic=False, optimizer=dict(epochs=2, mini_batch_size=4, micro_batch_size=2))
    batch = make_batch()
    batch.advantages[0, 0] = math.nan  # in each epoch row 0's mini-batch is skipped, the other one steps
    metrics = t.update(batch)
    assert t.state.optimizer_steps == 2 and t.state.nan_skips_total == 2
    assert metrics["skipped"] == 2  # a count of steps, not a mean of flags (which was 1.0)
    assert math.isfinite(metrics["grad_norm"]) and math.isfinite(metrics["pg_loss"])
    clean = update_stage(seed=3, critic=False, optimizer=dict(epochs=1, mini_batch_size=4, micro_batch_size=2))
    assert "skipped" not in clean.update(make_batch())


def test_skipped_steps_trip_the_monitor_from_the_first_iteration_and_twice_in_a_row_raise_the_alarm():
    from stppo_agent.monitoring.collapse_rules import CollapseMonitor, MonitorSettings

    monitor = CollapseMonitor(MonitorSettings(warmup=3, window=4, patience=2))
    first = monitor.observe(1, {"grad_norm": 1.0, "skipped": 1})  # warming up: the limit applies anyway
    assert [trip.key for trip in first.trips] == ["skipped"] and not first.alarm
    assert first.metrics()["collapse/tripped"] == 1
    assert not monitor.observe(2, {"grad_norm": 1.0}).trips  # absent: nothing was skipped
    monitor.observe(3, {"grad_norm": 1.0, "skipped": 2})
    assert monitor.observe(4, {"grad_norm": 1.0, "skipped": 1}).alarm


def test_a_skipped_step_with_a_finite_loss_adds_nothing_to_the_means_nor_to_the_off_policy_steps():
    """An inf gradient under a finite loss: the step is skipped, and its pg_loss / clip_frac describe no applied
    step (they were averaged in with the applied ones, and the step counted in offpolicy/steps)."""

    t = update_stage(seed=3, critic=False, optimizer=dict(epochs=2, mini_batch_size=4, micro_batch_size=2))
    updater = t
    real, calls = updater.actor_gradients, []

    def second_step_explodes(mini):
        calls.append(1)
        out = real(mini)
        if len(calls) == 2:  # the first off-policy step
            out.update(grad_norm=math.inf, pg_loss=1e6, clip_frac=1.0)
        return out

    updater.actor_gradients = second_step_explodes
    metrics = updater.update(make_batch())
    assert metrics["skipped"] == 1 and t.state.optimizer_steps == 3
    assert metrics["pg_loss"] < 1e3 and metrics["clip_frac"] < 1.0
    assert metrics["offpolicy/steps"] == 2  # steps 3 and 4; step 1 is on-policy, step 2 was skipped
