"""Config parsing: numbers in every common spelling, clear errors, and settings that cannot learn refused."""

from __future__ import annotations

import pytest

from stppo_agent.cli import main
from stppo_agent.training.config import TrainConfig, load_config
from stppo_agent.training.config_sections import OptimizerConfig, RolloutConfig


@pytest.mark.parametrize("raw, value", [("1e-6", 1e-6), ("1E-6", 1e-6), ("1e+3", 1000.0), ("2.5e-3", 2.5e-3),
                                        (".5", 0.5), ("5.", 5.0), ("-1e-2", -0.01), ("3", 3.0), ("0.001", 0.001)])
def test_numbers_parse_in_every_common_spelling(raw, value, tmp_path):
    config = load_config(None, [f"optimizer.actor_lr={raw}", f"algorithm.kl_in_reward={raw}", "model=m"])
    assert config.optimizer.actor_lr == value and isinstance(config.optimizer.actor_lr, float)
    assert config.algorithm_config().kl_in_reward == value
    path = tmp_path / "run.yaml"
    path.write_text(f"optimizer:\n  actor_lr: {raw}\nalgorithm:\n  entropy_coef: {raw}\n")
    from_file = load_config(path, [], model="m")
    assert from_file.optimizer.actor_lr == value and from_file.algorithm_config().entropy_coef == value


def test_strings_stay_strings():
    config = load_config(None, ["model=1e-6-model", "env=stppo/NQ-v0", "algorithm.kl_estimator=k3", "seed=7"])
    assert config.model == "1e-6-model" and config.seed == 7 and isinstance(config.seed, int)


@pytest.mark.parametrize("item, message", [("algorithm.clip_high=abc", "algorithm.clip_high expects float"),
                                           ("optimizer.actor_lr=fast", "actor_lr expects float"),
                                           ("iterations=1.5", "iterations expects int"),
                                           ("no_such_field=1", "unknown key 'no_such_field'"),
                                           ("algorithm.no_such=1", "unknown algorithm fields"),
                                           ("actor_lr", "expects key=value"),
                                           ("optimizer.actor_lr=[1", "not valid YAML")])
def test_bad_values_get_a_message_naming_the_field(item, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [item, "model=m"]).validate()


def test_a_broken_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("optimizer:\n  actor_lr: [1e-6\n")
    with pytest.raises(ValueError, match="broken.yaml is not valid YAML"):
        load_config(path, [])


@pytest.mark.parametrize("algo", ["grpo", "gspo", "so_grpo"])
def test_group_algorithms_refuse_groups_of_one(algo):
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        TrainConfig(algo=algo, model="m", rollout=RolloutConfig(samples_per_prompt=1)).validate()
    TrainConfig(algo=algo, model="m", rollout=RolloutConfig(samples_per_prompt=2),
                optimizer=OptimizerConfig(mini_batch_size=8, micro_batch_size=4)).validate()
    TrainConfig(algo="ppo", model="m", rollout=RolloutConfig(samples_per_prompt=1)).validate()  # GAE needs no group


def test_cli_reports_config_errors_without_a_traceback(capsys):
    assert main(["train", "--algo", "grpo", "--model", "m", "--output-dir", "/tmp/x"]) == 1
    assert "samples_per_prompt" in capsys.readouterr().err


PLUGIN = '''
import dataclasses
from stppo_agent.algorithms import ALGORITHMS, register_algorithm
register_algorithm(dataclasses.replace(ALGORITHMS["turn_ppo"], name="{name}", clip_high=0.31))
'''


def test_a_user_algorithm_is_chosen_from_the_cli_and_the_run_reproduces_from_its_folder(tmp_path, monkeypatch):
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
    from stppo_agent.runs.metrics_log import read_metrics

    (tmp_path / "my_algos.py").write_text(PLUGIN.format(name="my_algo"))
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    run = tmp_path / "run"
    common = ["--set", "rollout.prompts_per_iteration=2", "--set", "optimizer.mini_batch_size=2", "--set",
              "optimizer.micro_batch_size=2",
              "--set", "rollout.max_turns=2", "--set", "rollout.max_new_tokens_per_turn=1", "--set",
              "rollout.max_prompt_tokens=8",
              "--set", "rollout.max_total_tokens=32", "--set", "logging.progress=false", "--set", "checkpoint.every=1"]
    assert main(["train", "--algo", "my_algo", "--env", "stppo/Toy-v0", "--model", str(model), "--output-dir",
                 str(run), "--iterations", "1"] + common) == 1  # not imported: unknown
    assert main(["train", "--import", "my_algos", "--algo", "my_algo", "--env", "stppo/Toy-v0", "--model",
                 str(model), "--output-dir", str(run), "--iterations", "1"] + common) == 0
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["plugins"] == ["my_algos"] and saved["algo"] == "my_algo"
    assert saved["algorithm"]["clip_high"] == 0.31 and saved["algorithm"]["ratio_level"] == "turn"
    assert len(saved["algorithm"]) >= 15  # every resolved field, not only overrides
    # --resume reads the run's own config: no --algo, --model or --import needed
    assert main(["train", "--output-dir", str(run), "--resume", "--iterations", "2"]) == 0
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    # the resolved fields of one algorithm never leak into another chosen with --algo
    other = load_config(run / "config.yaml", [], algo="grpo", output_dir=str(tmp_path / "other"))
    assert other.algorithm_config().advantage == "grpo" and other.algorithm_config().ratio_level == "token"
