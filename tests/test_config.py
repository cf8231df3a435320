"""Config parsing: numbers in every common spelling, clear errors, and settings that cannot learn refused."""

from __future__ import annotations

import pytest

from stppo_agent.cli import main
from stppo_agent.config import TrainConfig, load_config


@pytest.mark.parametrize("raw, value", [("1e-6", 1e-6), ("1E-6", 1e-6), ("1e+3", 1000.0), ("2.5e-3", 2.5e-3),
                                        (".5", 0.5), ("5.", 5.0), ("-1e-2", -0.01), ("3", 3.0), ("0.001", 0.001)])
def test_numbers_parse_in_every_common_spelling(raw, value, tmp_path):
    config = load_config(None, [f"actor_lr={raw}", f"algorithm.kl_in_reward={raw}", "model=m"])
    assert config.actor_lr == value and isinstance(config.actor_lr, float)
    assert config.algorithm_config().kl_in_reward == value
    path = tmp_path / "run.yaml"
    path.write_text(f"actor_lr: {raw}\nalgorithm:\n  entropy_coef: {raw}\n")
    from_file = load_config(path, [], model="m")
    assert from_file.actor_lr == value and from_file.algorithm_config().entropy_coef == value


def test_strings_stay_strings():
    config = load_config(None, ["model=1e-6-model", "env=stppo/NQ-v0", "algorithm.kl_estimator=k3", "seed=7"])
    assert config.model == "1e-6-model" and config.seed == 7 and isinstance(config.seed, int)


@pytest.mark.parametrize("item, message", [("algorithm.clip_high=abc", "algorithm.clip_high expects float"),
                                           ("actor_lr=fast", "actor_lr expects float"),
                                           ("iterations=1.5", "iterations expects int"),
                                           ("no_such_field=1", "unknown config fields"),
                                           ("algorithm.no_such=1", "unknown algorithm fields"),
                                           ("actor_lr", "expects key=value"),
                                           ("actor_lr=[1", "not valid YAML")])
def test_bad_values_get_a_message_naming_the_field(item, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [item, "model=m"]).validate()


def test_a_broken_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("actor_lr: [1e-6\n")
    with pytest.raises(ValueError, match="broken.yaml is not valid YAML"):
        load_config(path, [])


@pytest.mark.parametrize("algo", ["grpo", "gspo", "so_grpo"])
def test_group_algorithms_refuse_groups_of_one(algo):
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        TrainConfig(algo=algo, model="m", samples_per_prompt=1).validate()
    TrainConfig(algo=algo, model="m", samples_per_prompt=2, mini_batch_size=8, micro_batch_size=4).validate()
    TrainConfig(algo="ppo", model="m", samples_per_prompt=1).validate()  # GAE needs no group


def test_cli_reports_config_errors_without_a_traceback(capsys):
    assert main(["train", "--algo", "grpo", "--model", "m", "--output-dir", "/tmp/x"]) == 1
    assert "samples_per_prompt" in capsys.readouterr().err
