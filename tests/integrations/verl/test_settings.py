"""``python -m stppo_agent.integrations.verl.settings PRESET``, the command that writes a preset's verl overrides
(docs/verl.md): a usage line without a preset, one line saying what to use for a preset verl cannot train, and the
stppo engine selected wherever the loss needs it. Needs no verl (the overrides merged into verl's own config are
tests/integrations/verl/test_bridge.py's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stppo_agent.algorithms import ALGORITHMS
from stppo_agent.integrations.verl import settings

ENGINE = "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR=stppo"


def test_without_a_preset_the_command_prints_its_usage():
    done = subprocess.run([sys.executable, "-m", "stppo_agent.integrations.verl.settings"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert "usage: python -m stppo_agent.integrations.verl.settings" in done.stderr
    assert "required: PRESET" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("name", ["turn_gae", "dapo", "no_such_preset"])
def test_a_preset_verl_cannot_train_is_one_line_that_says_what_to_use(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        settings.main([name])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "Traceback" not in err
    if name in ALGORITHMS:
        assert len(err.splitlines()) == 1 and f"error: preset {name}: " in err and "use stppo_" in err
    else:
        assert "invalid choice: 'no_such_preset'" in err and "st_ppo" in err


@pytest.mark.parametrize("name", [name for name in ALGORITHMS if settings.not_in_verl(ALGORITHMS[name]) is None])
def test_the_engine_is_selected_for_the_correction_and_the_turn_record(name, capsys):
    assert settings.main([name]) == 0
    overrides = capsys.readouterr().out.split()
    preset = ALGORITHMS[name]
    assert f"actor_rollout_ref.actor.policy_loss.loss_mode=stppo_{name}" in overrides
    assert (ENGINE in overrides) == (preset.clip_bias_correction or preset.ratio_level == "turn")
