"""A skipped (non-finite) step's importance ratios stay out of the next step's tails (session 15 skeptic probes)."""

from __future__ import annotations

import math

from .test_pins_training import make_batch, update_stage

# -- a skipped (non-finite) step's importance ratios stay out of the next step's tails ------------------------------

def _diagnosed_trainer():
    from stppo_agent.monitoring.step_diagnostics import StepDiagnostics

    t = update_stage(critic=False, monitor=dict(max_nan_skips=5))
    t.diagnostics = StepDiagnostics(None, gradients=False)
    return t


def _far_off_policy_nan_step():
    mini = make_batch().select([0, 1, 2, 3])
    mini.advantages[0, 0] = math.nan  # the step is skipped
    mini.old_logprobs[:] = -30.0  # and its ratios are e^20 and more
    return mini


def test_a_skipped_steps_ratios_do_not_leak_into_the_next_applied_steps_tails():
    """The skipped step observed its micro-batches' ratios but never finished: the next applied step's tails
    (tail/ratio_max, _p99, ..., collapse signals of the off-policy family) were taken over both mini-batches, so a
    clean step logged the skipped one's e^20 ratios (or NaN, which the monitor ignores)."""

    t = _diagnosed_trainer()
    updater = t
    assert updater._optimizer_step(_far_off_policy_nan_step())["skipped"] == 1.0
    after_skip = updater._optimizer_step(make_batch().select([0, 1, 2, 3]))
    alone = _diagnosed_trainer()._optimizer_step(make_batch().select([0, 1, 2, 3]))
    tails = [key for key in alone if key.startswith("tail/")]
    assert tails and alone["tail/ratio_max"] < 10
    assert {key: after_skip[key] for key in tails} == {key: alone[key] for key in tails}


def test_a_skipped_last_step_does_not_leak_into_the_next_iterations_first_step():

    t = _diagnosed_trainer()
    updater = t
    t.diagnostics.begin_iteration(1)
    updater._optimizer_step(_far_off_policy_nan_step())
    t.diagnostics.begin_iteration(2)
    first = updater._optimizer_step(make_batch().select([0, 1, 2, 3]))
    assert first["tail/ratio_max"] < 10
