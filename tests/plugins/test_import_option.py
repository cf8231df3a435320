"""`--import` as a researcher types it: a file next to them, a module in the current directory, on train and replay;
a plugin that cannot be imported is one line naming the file and the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stppo_agent.cli import main
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer

RULE = '''
import dataclasses
from stppo_agent.algorithms import ALGORITHMS, register_algorithm
register_algorithm(dataclasses.replace(ALGORITHMS["{base}"], name="{name}", clip_high=0.31))
'''
FAST = ["--env", "stppo/Toy-v0", "--iterations", "1", "--set", "rollout.prompts_per_iteration=2", "--set",
        "optimizer.mini_batch_size=2", "--set", "optimizer.micro_batch_size=2", "--set", "rollout.max_turns=2", "--set",
        "rollout.max_new_tokens_per_turn=1", "--set", "rollout.max_prompt_tokens=8", "--set",
        "rollout.max_total_tokens=32", "--set",
        "logging.progress=false", "--set", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


def test_a_plugin_file_in_the_current_directory_trains_and_replays(model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rule_file_a.py").write_text(RULE.format(base="turn_ppo", name="rule_a"))
    (tmp_path / "rule_file_b.py").write_text(RULE.format(base="ppo", name="rule_b"))
    assert main(["train", "--import", "./rule_file_a.py", "--algo", "rule_a", "--model", str(model),
                 "--output-dir", "run", "--set", "logging.save_rollouts=true", *FAST]) == 0, capsys.readouterr().err
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    # recorded as an absolute path: --resume and replay find it from any directory
    assert saved["plugins"] == [str(tmp_path / "rule_file_a.py")] and saved["algorithm"]["clip_high"] == 0.31
    # replay through a second rule from another file: the recorded plugin is imported again, the new one added
    assert main(["replay", "run", "--import", "rule_file_b.py", "--algo", "rule_b", "--output-dir", "rep",
                 "--set", "logging.progress=false", "--set", "logging.tensorboard=false"]) == 0, capsys.readouterr().err
    replayed = yaml.safe_load((tmp_path / "rep" / "config.yaml").read_text())
    assert replayed["algo"] == "rule_b"
    assert replayed["plugins"] == [str(tmp_path / "rule_file_a.py"), str(tmp_path / "rule_file_b.py")]


@pytest.mark.parametrize("content, spec, expected", [
    (None, "./missing_plugin.py", "missing_plugin.py does not exist"),
    ("raise RuntimeError('no GPU here')\n", "./raising_plugin.py",
     "raising_plugin.py failed to import: RuntimeError: no GPU here"),
    ("def broken(:\n", "./syntax_plugin.py", "syntax_plugin.py failed to import: SyntaxError"),
    ("import not_installed_dependency_xyz\n", "dep_plugin", "dep_plugin.py) failed to import: "
                                                           "ModuleNotFoundError: No module named "
                                                           "'not_installed_dependency_xyz'"),
    (None, "no_such_plugin_module", "cannot import plugin module 'no_such_plugin_module': no "
                                    "no_such_plugin_module.py in the current directory"),
])
def test_a_plugin_that_cannot_be_imported_is_one_line_naming_it(tmp_path, monkeypatch, capsys, content, spec,
                                                                  expected):
    monkeypatch.chdir(tmp_path)
    if content is not None:
        (tmp_path / (spec.removeprefix("./").removesuffix(".py") + ".py")).write_text(content)
    for command in (["train", "--algo", "ppo", "--model", "m", "--output-dir", "run", *FAST],
                    ["eval", "--agent", "oracle", "--benchmarks", "nq", "--output-dir", "out"]):
        code = main([*command[:1], "--import", spec, *command[1:]])
        err = capsys.readouterr().err
        assert code == 1 and expected in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_the_console_script_finds_a_module_in_the_current_directory(tmp_path):
    # `stppo` (the console script) does not put the current directory on sys.path as `python -m` does
    (tmp_path / "myrule_console.py").write_text(RULE.format(base="ppo", name="my_rule_console")
                                                + "open('imported', 'w').write('yes')\n")
    script = Path(sys.executable).with_name("stppo")
    if not script.exists():
        pytest.skip("the stppo console script is not installed next to this Python")
    # an unknown env stops the command right after the algorithm was found, before any model is loaded
    result = subprocess.run([str(script), "train", "--import", "myrule_console", "--algo", "my_rule_console",
                             "--env", "stppo/Nope-v0", "--model", "m", "--output-dir", "run"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": ""})
    assert (tmp_path / "imported").exists(), result.stderr
    assert result.returncode == 1 and "stppo/Nope-v0" in result.stderr and "plugin" not in result.stderr, \
        result.stderr
