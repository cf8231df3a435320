"""``stppo_agent.training.config_sections``: sections spelled ``section.key``
in --set, YAML and config.yaml; the refusals that name the right key; a run folder's flat config.yaml of an
earlier version still loading; each rule's own settings."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml

from stppo_agent.algorithms import Hyperparameter, register_algorithm, register_policy_loss
from stppo_agent.algorithms.config import AlgorithmConfig
from stppo_agent.cli import main
from stppo_agent.runs.config_yaml import RENAMED
from stppo_agent.training.config import TrainConfig, from_dict, load_config, setting_names
from stppo_agent.training.config_sections import SECTIONS

FLAT = Path(__file__).resolve().parents[1] / "data" / "flat_config_0.1.yaml"
# the settings FLAT records that differ from the defaults, in the grouped names
FLAT_SETTINGS = ["rollout.samples_per_prompt=4", "optimizer.actor_lr=3e-6", "rollout.max_turns=3", "checkpoint.every=5",
                 "checkpoint.optimizer=newest", "monitor.window=12", "monitor.thresholds.kl_to_reference=2.0",
                 "logging.tensorboard=false", "rollout.staleness=2", "optimizer.epochs=2", "algorithm.clip_high=0.28"]
FLAT_FLAGS = dict(algo="st_ppo", env="stppo/Toy-v0", model="tiny", output_dir="runs/old", iterations=7)


def test_every_section_key_round_trips_through_yaml(tmp_path):
    every = ["rollout.samples_per_prompt=8", "rollout.backend=vllm", "optimizer.actor_lr=2e-5", "optimizer.epochs=3",
             "precision.dtype=bfloat16", "checkpoint.dtype=bfloat16", "checkpoint.every=4", "monitor.z=4.5",
             "monitor.thresholds.response_tokens=0.5", "distributed.strategy=fsdp2", "logging.progress=false",
             "algorithm.clip_high=0.28", "env_kwargs.topk=5", "seed=3"]
    config = load_config(None, every, model="m")
    assert (config.rollout.samples_per_prompt, config.optimizer.actor_lr, config.checkpoint.dtype) == (8, 2e-5,
                                                                                                        "bfloat16")
    assert config.monitor.thresholds == {"kl_to_reference": 1.0, "response_tokens": 0.5}  # one key set: the rest kept
    path = tmp_path / "config.yaml"
    path.write_text(config.to_yaml())
    assert load_config(path) == config
    written = yaml.safe_load(path.read_text())
    assert set(SECTIONS) <= set(written) and written["checkpoint"]["dtype"] == "bfloat16"
    assert not set(written) & set(RENAMED) - set(TrainConfig.__dataclass_fields__)  # no flat name written


def test_a_run_folders_config_yaml_round_trips_with_the_resolved_algorithm(tmp_path):
    config = load_config(None, ["algorithm.clip_high=0.28", "rollout.samples_per_prompt=2"], algo="grpo", model="m")
    path = tmp_path / "config.yaml"
    path.write_text(config.to_yaml(resolved=config.algorithm_config()))
    again = load_config(path)
    assert dataclasses.replace(again, algorithm=config.algorithm, algorithm_resolved=None) == config
    assert again.algorithm_config() == config.algorithm_config()


@pytest.mark.parametrize("key, suggestion", [
    ("rollout.sample_per_prompt", "rollout.samples_per_prompt"),
    ("rollout.actor_lr", "optimizer.actor_lr"),  # the key in another section
    ("sample_per_prompt", "rollout.samples_per_prompt"),
    ("checkpoint.checkpoint_dtype", "checkpoint.dtype"),
    ("optimizer.actor_lrr", "optimizer.actor_lr"),
])
def test_an_unknown_key_names_the_closest_one_with_its_section(key, suggestion):
    with pytest.raises(ValueError, match=rf"^unknown key '{key}'; did you mean '{suggestion}'\?"):
        load_config(None, [f"{key}=1"])


def test_an_unknown_key_in_a_yaml_section_is_refused_the_same_way(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  sample_per_prompt: 4\n")
    with pytest.raises(ValueError, match=r"unknown key 'rollout.sample_per_prompt'; did you mean "
                                         r"'rollout.samples_per_prompt'\?"):
        load_config(path)


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_every_old_flat_name_is_refused_on_the_command_line_naming_its_new_place(old):
    new = RENAMED[old]
    assert new in setting_names()
    with pytest.raises(ValueError, match=rf"^'{old}' is now '{new}'"):
        load_config(None, [f"{old}=1"])


def test_the_cli_refuses_an_old_name_in_one_line(capsys):
    assert main(["train", "--model", "m", "--set", "actor_lr=1e-3"]) == 1
    assert capsys.readouterr().err.strip() == ("stppo train: error: 'actor_lr' is now 'optimizer.actor_lr' "
                                               "(--set optimizer.actor_lr=...)")
    with pytest.raises(AttributeError, match="TrainConfig.actor_lr is now TrainConfig.optimizer.actor_lr"):
        TrainConfig().actor_lr  # noqa: B018


def test_a_flat_config_yaml_of_an_earlier_version_loads_in_the_sections_with_one_note(capsys):
    loaded = load_config(FLAT)
    expected = load_config(None, FLAT_SETTINGS, **FLAT_FLAGS)  # the same settings, grouped
    assert dataclasses.replace(loaded, algorithm=expected.algorithm, algorithm_resolved=None) == expected
    assert loaded.algorithm_config() == expected.algorithm_config()  # the file holds every resolved field
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and note[0].startswith(f"note: {FLAT} is in the flat layout of earlier stppo versions")
    assert loaded.monitor.thresholds == {"kl_to_reference": 2.0} and loaded.checkpoint.optimizer == "newest"


def test_a_flat_run_folder_resumes_replays_and_evaluates(tmp_path, capsys):
    from stppo_agent.runs.run_summary import eval_command
    from stppo_agent.runs.trainer_state import check_resume_settings
    from stppo_agent.training.replay import recorded_config

    run = tmp_path / "run"
    step = run / "checkpoints" / "step-3"
    step.mkdir(parents=True)
    shutil.copy(FLAT, run / "config.yaml")
    flat = yaml.safe_load(FLAT.read_text())
    (step / "trainer_state.json").write_text(json.dumps({"iteration": 3, "config": flat}))
    assert recorded_config(run) == load_config(FLAT)  # stppo replay's reading of the run
    config = load_config(run / "config.yaml")  # what --resume reads when no --config is given
    reported = []
    check_resume_settings(config, config.algorithm_config(), step, report=reported.append)  # nothing changed
    assert not reported
    changed = dataclasses.replace(config, precision=dataclasses.replace(config.precision, dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"--resume cannot change precision.dtype \(float32 -> bfloat16\)"):
        check_resume_settings(changed, changed.algorithm_config(), step)
    assert "--max-turns 3" in eval_command(str(run), flat)  # the summary's evaluation command


def test_train_help_lists_every_setting_by_section(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name in setting_names():
        if name != "algorithm_resolved":  # written by the trainer, never set
            assert f"    {name}=" in out, name
    assert "  checkpoint: When checkpoints are written" in out


def test_train_algo_help_lists_what_that_rules_read(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--algo", "sapo", "--help"])
    out = capsys.readouterr().out.split("algorithm sapo:")[1]
    assert "policy loss sapo reads:" in out and "    tau_pos = 1.0" in out and "    tau_neg = 1.05" in out
    assert "    grpo_std_normalize = True" in out  # its advantage estimator's
    assert "m2_threshold" not in out and "gamma" not in out  # other rules' fields are left out
    assert "    kl_loss_coef = 0.0" in out  # shared by every rule


PLUGIN = '''
from stppo_agent.algorithms import AlgorithmConfig, Hyperparameter, get_policy_loss, register_algorithm
from stppo_agent.algorithms import register_policy_loss

@register_policy_loss("scaled_clip", reads=("clip_low", "clip_high"),
                      hyperparameters=[Hyperparameter("loss_scale", 0.5, "multiplies the clipped surrogate")])
def scaled_clip(*, config, **kwargs):
    loss, bias, metrics = get_policy_loss("ppo_clip")(config=config, **kwargs)
    return config.hyperparameter("loss_scale") * loss, bias, metrics

register_algorithm(AlgorithmConfig(name="scaled_ppo", policy_loss="scaled_clip"))
'''


def test_a_plugin_rule_declares_a_hyperparameter_that_help_lists_and_set_reaches(tmp_path, capsys):
    plugin = tmp_path / "scaled.py"
    plugin.write_text(PLUGIN)
    with pytest.raises(SystemExit):
        main(["train", "--import", str(plugin), "--algo", "scaled_ppo", "--help"])
    out = capsys.readouterr().out
    assert "    loss_scale = 0.5  (its own) multiplies the clipped surrogate" in out
    config = load_config(None, ["algorithm.loss_scale=2"], algo="scaled_ppo", model="m")
    config.plugins = [str(plugin)]
    algo = config.algorithm_config()
    assert algo.hyperparameter("loss_scale") == 2.0 and isinstance(algo.hyperparameter("loss_scale"), float)
    written = yaml.safe_load(config.to_yaml(resolved=algo))
    assert written["algorithm"]["loss_scale"] == 2.0  # recorded beside the other algorithm fields
    assert from_dict(written).algorithm_config() == algo
    with pytest.raises(ValueError, match=r"unknown algorithm fields \['loss_scal'\] \(did you mean loss_scale\?\)"):
        load_config(None, ["algorithm.loss_scal=2"], algo="scaled_ppo", model="m", plugins=[str(plugin)]) \
            .algorithm_config()
    with pytest.raises(ValueError, match="algorithm.loss_scale expects float"):
        load_config(None, ["algorithm.loss_scale=big"], algo="scaled_ppo", model="m", plugins=[str(plugin)]) \
            .algorithm_config()


def test_a_declaration_must_name_real_fields_and_new_hyperparameters():
    with pytest.raises(ValueError, match="reads \\['clip_hgh'\\], which AlgorithmConfig lacks"):
        register_policy_loss("bad_reads", lambda **_: None, reads=("clip_hgh",))
    with pytest.raises(ValueError, match="'clip_low' is already an AlgorithmConfig field"):
        register_policy_loss("bad_own", lambda **_: None, hyperparameters=[Hyperparameter("clip_low", 0.1)])
    with pytest.raises(KeyError, match="no hyper-parameter 'beta' declared by policy loss ppo_clip"):
        AlgorithmConfig().hyperparameter("beta")
    assert register_algorithm  # the registry a plugin's preset goes to


def test_set_of_a_nested_key_reaches_the_trainer(monkeypatch, tmp_path, capsys):
    import stppo_agent.training.trainer as trainer_module

    seen = {}

    class Recording:
        def __init__(self, config, resume=False, overwrite=False):
            seen["config"] = config

        def train(self):
            return {"reward": 0.0}

    monkeypatch.setattr(trainer_module, "Trainer", Recording)
    assert main(["train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", str(tmp_path),
                 "--output-dir", str(tmp_path / "run"), "--json", "--set", "rollout.samples_per_prompt=3",
                 "--set", "optimizer.actor_lr=5e-3", "--set", "monitor.thresholds.kl_to_reference=0.25"]) == 0
    config = seen["config"]
    assert (config.rollout.samples_per_prompt, config.optimizer.actor_lr) == (3, 5e-3)
    assert config.monitor.thresholds == {"kl_to_reference": 0.25}


def test_sectioned_overrides_keep_the_section_defaults():
    c = load_config(None, ["monitor.thresholds.entropy=0.5"])
    assert c.monitor.thresholds == {"kl_to_reference": 1.0, "entropy": 0.5}
    c = load_config(None, ["env_kwargs.topk=3", "env_kwargs.split=dev"])
    assert c.env_kwargs == {"topk": 3, "split": "dev"}
    c = load_config(None, ["algorithm.clip_high=0.3", "algorithm.clip_high=0.35"])
    assert c.algorithm == {"clip_high": 0.35}
    assert TrainConfig().monitor.thresholds is not TrainConfig().monitor.thresholds
    assert load_config(None, ["env_kwargs.a.b=1"]).env_kwargs == {"a.b": 1}  # the first dot splits
    c = load_config(None, ["monitor.thresholds.kl_to_reference=2"])
    assert TrainConfig().monitor.thresholds == {"kl_to_reference": 1.0} and c.monitor.thresholds[
        "kl_to_reference"] == 2
