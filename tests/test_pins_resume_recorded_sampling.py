"""Pins of stppo_agent/runs/resume_settings.py's refusal to change a recording run's sampling on resume: the
message word for word (it names the old value) and the boundary (nothing was recorded before iteration 1)."""

from __future__ import annotations

import pytest

from stppo_agent.runs.resume_settings import check

RECORDING = {"logging": {"save_rollouts": True}}


def test_a_recording_run_refuses_a_new_temperature_naming_the_old_one():
    with pytest.raises(ValueError) as info:
        check({**RECORDING, "rollout": {"temperature": 1.0}}, {**RECORDING, "rollout": {"temperature": 0.7}}, 3)
    assert str(info.value) == (
        "--resume cannot change rollout.temperature (1.0 -> 0.7): iterations 1..3 were recorded sampled with "
        "rollout.temperature=1.0, and stppo replay takes one setting for every recorded iteration. Start a new run in "
        "another --output-dir instead (--model RUN/checkpoints/step-N/actor starts it from these weights)")


def test_an_unset_old_setting_is_shown_as_unset():
    with pytest.raises(ValueError, match=r"recorded sampled with precision.generation_autocast_dtype=unset, and"):
        check(RECORDING, {**RECORDING, "precision": {"generation_autocast_dtype": "bfloat16"}}, 1)


def test_at_iteration_zero_nothing_was_recorded_so_sampling_may_change():
    assert check({**RECORDING, "rollout": {"top_k": 0}}, {**RECORDING, "rollout": {"top_k": 5}}, 0) == \
        [("rollout.top_k", 0, 5)]


def test_a_run_that_does_not_record_may_change_its_sampling():
    plain = {"logging": {"save_rollouts": False}}
    assert check({**plain, "rollout": {"top_p": 1.0}}, {**plain, "rollout": {"top_p": 0.9}}, 4) == \
        [("rollout.top_p", 1.0, 0.9)]
