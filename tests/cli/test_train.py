"""``stppo train`` (stppo_agent/cli/train.py): flags and ``--set`` items reaching the trainer,
plugins imported before the config, ``--json``, a resume reading the run's own config, the checks before the
trainer is built."""

from __future__ import annotations

import json

from stppo_agent.training.config_sections import OptimizerConfig
from tests.support.cli_calls import Calls, plugin_file, run, usage_error

# ---------------------------------------------------------------- train


class FakeTrainer:
    made: list = []

    def __init__(self, config, resume=False, overwrite=False):
        FakeTrainer.made.append((config, resume, overwrite))

    def train(self):
        return {"iteration": 1, "reward": 0.25, "ok": True, "algo": "grpo", "per_turn": [1, 2]}


def _train(monkeypatch):
    from stppo_agent.models import default_model
    from stppo_agent.runs import run_summary
    from stppo_agent.training import trainer

    FakeTrainer.made = []
    monkeypatch.setattr(trainer, "Trainer", FakeTrainer)
    monkeypatch.setattr(default_model, "resolve_model", Calls(lambda name: f"resolved/{name}"))
    monkeypatch.setattr(run_summary, "run_summary", Calls(lambda run_dir, title: f"SUMMARY {run_dir} | {title}"))
    return FakeTrainer.made, run_summary.run_summary


def test_train_flags_and_sets_reach_the_trainer(monkeypatch, capsys, tmp_path):
    made, summary = _train(monkeypatch)
    plugin = plugin_file(tmp_path)
    code, out, err = run(capsys, "train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", "tiny",
                         "--output-dir", str(tmp_path / "run"), "--iterations", "2", "--set", "optimizer.actor_lr=3e-6",
                         "--set", "algorithm.clip_high=0.3", "--import", str(plugin), "--import", str(plugin))
    assert (code, err) == (0, "")
    (config, resume, overwrite), = made
    assert (resume, overwrite) == (False, False)
    assert (config.algo, config.env, config.model, config.output_dir, config.iterations, config.optimizer.actor_lr) == \
        ("grpo", "stppo/Toy-v0", "resolved/tiny", str(tmp_path / "run"), 2, 3e-6)
    assert config.algorithm["clip_high"] == 0.3 and config.plugins == [str(plugin)]  # absolute, once
    assert out == f"SUMMARY {tmp_path / 'run'} | trained\n" and len(summary.calls) == 1
    run(capsys, "train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", "tiny", "--output-dir",
        str(tmp_path / "run"), "--overwrite")
    assert made[-1][1:] == (False, True) and made[-1][0].iterations == 100


def test_train_imports_join_the_configs_plugins_after_them(monkeypatch, capsys, tmp_path):
    from stppo_agent.training.config import TrainConfig

    made, _ = _train(monkeypatch)
    first, second = plugin_file(tmp_path), plugin_file(tmp_path, "_b")
    config = tmp_path / "config.yaml"
    config.write_text(TrainConfig(algo="grpo", env="stppo/Toy-v0", model="tiny", plugins=[str(first)]).to_yaml())
    assert run(capsys, "train", "--config", str(config), "--output-dir", str(tmp_path / "run"),
               "--import", str(second))[0] == 0
    assert made[-1][0].plugins == [str(first), str(second)]


def test_train_json_prints_the_numbers_only(monkeypatch, capsys, tmp_path):
    made, summary = _train(monkeypatch)
    code, out, _ = run(capsys, "train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", "tiny",
                       "--output-dir", str(tmp_path / "run"), "--json")
    assert code == 0 and summary.calls == []
    assert out == json.dumps({"iteration": 1, "reward": 0.25, "ok": True}, indent=1) + "\n"


def test_train_resume_reads_the_runs_own_config_unless_one_is_given(monkeypatch, capsys, tmp_path):
    from stppo_agent.training.config import TrainConfig

    made, _ = _train(monkeypatch)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text(TrainConfig(algo="grpo", env="stppo/Toy-v0", model="tiny",
                                                    output_dir=str(folder),
                                                    optimizer=OptimizerConfig(actor_lr=5e-6)).to_yaml())
    other = tmp_path / "other.yaml"
    other.write_text(TrainConfig(algo="ppo", env="stppo/Toy-v0", model="tiny",
                                 optimizer=OptimizerConfig(actor_lr=7e-6)).to_yaml())
    assert run(capsys, "train", "--resume", "--output-dir", str(folder))[0] == 0
    config, resume, overwrite = made[-1]
    assert (config.algo, config.optimizer.actor_lr, config.model, resume, overwrite) == ("grpo", 5e-6,
                                                                                         "resolved/tiny", True,
                                                                               False)
    run(capsys, "train", "--resume", "--output-dir", str(folder), "--config", str(other))
    assert (made[-1][0].algo, made[-1][0].optimizer.actor_lr) == ("ppo", 7e-6)
    run(capsys, "train", "--output-dir", str(folder), "--env", "stppo/Toy-v0", "--model", "tiny")
    assert (made[-1][0].algo, made[-1][0].optimizer.actor_lr, made[-1][1]) == ("st_ppo", 1e-6,
                                                                               False)  # no --resume: defaults
    run(capsys, "train", "--resume", "--output-dir", str(tmp_path / "new"), "--env", "stppo/Toy-v0", "--model", "m/x")
    assert (made[-1][0].algo, made[-1][0].model, made[-1][1]) == ("st_ppo", "resolved/m/x", True)


def test_train_checks_run_before_the_trainer(monkeypatch, capsys, tmp_path):
    made, _ = _train(monkeypatch)
    base = ["train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", "tiny", "--output-dir", str(tmp_path)]
    code, _, err = run(capsys, *base, "--set", "checkpoint.optimizer=newest", "--set", "monitor.on_collapse=rollback")
    assert code == 1 and "checkpoint.optimizer=newest drops the optimizer state" in err
    code, _, err = run(capsys, *base, "--set", "checkpoint.dtype=int3")
    assert code == 1 and "checkpoint.dtype must be" in err
    code, _, err = run(capsys, *base[:2], "st_ppp", *base[3:])
    assert code == 1 and "did you mean st_ppo?" in err
    assert made == []
    assert "must be >= 1" in usage_error(capsys, *base, "--iterations", "0")


def test_train_no_model_stays_unresolved_and_only_the_main_process_prints(monkeypatch, capsys, tmp_path):
    from stppo_agent.distributed import process_group
    from stppo_agent.models import default_model

    made, summary = _train(monkeypatch)
    monkeypatch.setattr(process_group, "is_main", lambda: False)
    assert run(capsys, "train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--output-dir", str(tmp_path)) == \
        (0, "", "")
    assert made[-1][0].model == "" and default_model.resolve_model.calls == [] and summary.calls == []
