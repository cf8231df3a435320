"""``stppo_agent.runs.trainer_state``: the config a checkpoint records, and the
resume checks made against it before any model loads."""

from __future__ import annotations

import json

import pytest

from tests.support.checkpoints import checkpoint_of, fake_run


def test_checkpoint_config_reads_the_checkpoints_record_else_the_runs_config_yaml(tmp_path):
    from stppo_agent.runs.trainer_state import checkpoint_config

    folder = tmp_path / "run" / "checkpoints" / "step-1"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"iteration": 1, "config": {"actor_lr": 0.3}}))
    assert checkpoint_config(folder) == {"optimizer": {"actor_lr": 0.3}}  # an earlier version's flat record
    (folder / "trainer_state.json").write_text(json.dumps({"iteration": 1}))
    assert checkpoint_config(folder) is None
    (tmp_path / "run" / "config.yaml").write_text("actor_lr: 1e-6\nalgo: ppo\n")
    assert checkpoint_config(folder) == {"optimizer": {"actor_lr": 1e-6}, "algo": "ppo"}


def test_check_resume_settings_refuses_a_fixed_change_before_the_models_load(tmp_path):
    from stppo_agent.runs.trainer_state import check_resume_settings

    def check(folder, **overrides):
        config = fake_run(tmp_path, **overrides)[1]
        check_resume_settings(config, config.algorithm_config(), folder, report=lambda _: None)

    folder = checkpoint_of(fake_run(tmp_path), tmp_path / "run")
    check(folder, optimizer=dict(actor_lr=0.9))
    check(None, seed=5)
    with pytest.raises(ValueError, match=r"--resume cannot change seed \(0 -> 5\)"):
        check(folder, seed=5)
    with pytest.raises(ValueError, match="cannot change logging.save_rollouts .*iterations 1..6"):
        check(folder, logging=dict(save_rollouts=True))
