"""What a checkpoint holds per parameter, and a run that keeps checkpoints small: weights in bfloat16, optimizer
state only in the newest checkpoint, still resumable after kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stppo_agent.models.tiny import build_tiny_llama, toy_train_command, word_tokenizer
from stppo_agent.runs.checkpoint import OPTIMIZER_FILE, NoOptimizerStateError, load_trainer_state, verify_checkpoint
from stppo_agent.runs.metrics_log import read_metrics
from tests.support.cli_in_process import stppo
from tests.support.paths import REPO

SMALL = ["--set", "checkpoint.dtype=bfloat16", "--set", "checkpoint.optimizer=newest"]


def train_arguments(out: Path, iterations: int, *extra: str) -> list[str]:
    return ["train", "--algo", "st_ppo", "--env", "stppo/Toy-v0", "--model", "tiny", "--output-dir", str(out),
            "--iterations", str(iterations), "--set", "checkpoint.every=1", "--set", "checkpoint.keep=2", "--set",
            "logging.tensorboard=false", "--set", "logging.progress=false", *extra]


def train(out: Path, iterations: int, *extra: str, capsys, check: bool = True) -> subprocess.CompletedProcess:
    done = stppo(*train_arguments(out, iterations, *extra), capsys=capsys)
    assert not check or done.returncode == 0, done.stderr[-3000:]
    return done


def parameters(folder: Path) -> tuple[int, torch.dtype]:
    tensors = load_file(folder / "model.safetensors")
    return sum(t.numel() for t in tensors.values()), next(iter(tensors.values())).dtype


def test_a_default_checkpoint_holds_4_bytes_per_weight_and_8_per_parameter_of_optimizer_state(tmp_path, capsys):
    train(tmp_path / "run", 2, capsys=capsys)
    for step in (1, 2):  # checkpoint_optimizer=all: every kept checkpoint resumes
        folder = tmp_path / "run" / "checkpoints" / f"step-{step}"
        actor, dtype = parameters(folder / "actor")
        critic, _ = parameters(folder / "critic")
        assert dtype == torch.float32
        weights = (folder / "actor" / "model.safetensors").stat().st_size
        assert 4 * actor <= weights <= 4 * actor * 1.05 + 4096  # safetensors' header is the rest
        optimizer = (folder / OPTIMIZER_FILE).stat().st_size  # AdamW: two float32 moments per parameter
        assert 8 * (actor + critic) <= optimizer <= 8 * (actor + critic) * 1.25 + 65536
        assert (folder / "trainer_state.pt").stat().st_size < optimizer / 4  # schedules and random streams
        tensors, _ = load_trainer_state(folder)
        assert {"actor_optimizer", "critic_optimizer", "actor_scheduler"} <= set(tensors)


def test_a_small_run_keeps_bfloat16_weights_and_the_optimizer_state_only_in_the_newest(tmp_path, capsys):
    run = tmp_path / "run"
    said = train(run, 3, *SMALL, capsys=capsys).stdout
    older, newest = (run / "checkpoints" / f"step-{s}" for s in (2, 3))
    assert not (run / "checkpoints" / "step-1").exists()
    assert (newest / OPTIMIZER_FILE).exists() and not (older / OPTIMIZER_FILE).exists()
    verify_checkpoint(older)  # its manifest no longer lists what was dropped
    assert OPTIMIZER_FILE not in json.loads((older / "manifest.json").read_text())
    actor, dtype = parameters(newest / "actor")
    assert dtype == torch.bfloat16 and (newest / "actor" / "model.safetensors").stat().st_size <= 2 * actor + 4096
    with pytest.raises(NoOptimizerStateError, match="holds no optimizer state"):
        load_trainer_state(older)
    assert load_trainer_state(older, optimizer=False)[1]["iteration"] == 2
    assert "checkpoints/step-3 (" in said  # the summary names the newest

    # a drop cut short by kill -9 (manifest rewritten, file not yet removed): still verifies, never read
    shutil.copy(newest / OPTIMIZER_FILE, older / OPTIMIZER_FILE)
    verify_checkpoint(older)
    with pytest.raises(NoOptimizerStateError):
        load_trainer_state(older)

    train(run, 4, *SMALL, "--resume", capsys=capsys)  # resumes from the newest (bfloat16 weights back into float32)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert not (run / "checkpoints" / "step-3" / OPTIMIZER_FILE).exists()  # dropped once step-4 was complete

    # the newest corrupt: the older one cannot resume, and the error says why and what its weights can do
    data = bytearray((run / "checkpoints" / "step-4" / OPTIMIZER_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (run / "checkpoints" / "step-4" / OPTIMIZER_FILE).write_bytes(bytes(data))
    refused = train(run, 5, *SMALL, "--resume", capsys=capsys, check=False)
    assert refused.returncode == 1 and "step-3 holds no optimizer state" in refused.stderr
    assert "--model" in refused.stderr and "Traceback" not in refused.stderr


def test_a_weights_only_run_writes_no_optimizer_state_and_its_resume_is_refused_with_what_its_weights_can_do(
        tmp_path, capsys):
    run = tmp_path / "run"
    train(run, 2, "--set", "checkpoint.optimizer=none", "--set", "rollout.staleness=1", capsys=capsys)
    for step in (1, 2):
        folder = run / "checkpoints" / f"step-{step}"
        verify_checkpoint(folder)
        assert sorted(p.name for p in folder.iterdir()) == ["actor", "critic", "manifest.json", "trainer_state.json",
                                                            "trainer_state.pt"]  # nor the lagged copies
        assert parameters(folder / "actor")[1] == torch.float32
    refused = train(run, 3, "--set", "checkpoint.optimizer=none", "--set", "rollout.staleness=1", "--resume",
                    capsys=capsys, check=False)
    assert refused.returncode == 1 and "step-2 holds no optimizer state (its run wrote none" in refused.stderr
    assert f"--model {run / 'checkpoints' / 'step-2' / 'actor'}" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert [r["step"] for r in read_metrics(run)] == [1, 2]  # the refused resume lost nothing


@pytest.mark.parametrize("bad, message", [
    (["--set", "checkpoint.dtype=int8"], "checkpoint.dtype must be bfloat16, float16, float32 or null"),
    (["--set", "checkpoint.optimizer=latest"], "checkpoint.optimizer must be all, newest or none"),
    (["--set", "checkpoint.optimizer=newest", "--set", "monitor.on_collapse=rollback"], "use checkpoint.optimizer=all"),
    (["--set", "checkpoint.optimizer=none", "--set", "monitor.on_collapse=rollback"],
     "none never writes the optimizer"),
])
def test_bad_checkpoint_settings_are_one_line_before_training(tmp_path, bad, message, capfd, monkeypatch):
    from stppo_agent.cli import main

    # refused before the trainer (models, transformers' modelling code) is even imported: a typo answers at once
    monkeypatch.setitem(sys.modules, "stppo_agent.training.trainer", None)  # importing it raises ImportError
    code = main(train_arguments(tmp_path / "run", 1, *bad))
    stderr = capfd.readouterr().err
    assert code == 1 and message in stderr and "Traceback" not in stderr, stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_kill_9_then_resume_with_the_optimizer_state_in_the_newest_only_matches_an_uninterrupted_run(tmp_path):
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    iterations, newest = 8, ["--set", "checkpoint.optimizer=newest"]
    interrupted, reference = tmp_path / "interrupted", tmp_path / "reference"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(toy_train_command(model, interrupted, iterations) + newest, env=env, cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while not (interrupted / "checkpoints" / "step-3").exists():
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        assert time.time() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    killed_at = max(int(p.name.split("-")[1]) for p in (interrupted / "checkpoints").glob("step-*"))
    assert killed_at < iterations, "the run finished before it could be killed; the test needs a longer run"
    for command in (toy_train_command(model, interrupted, iterations, resume=True) + newest,
                    toy_train_command(model, reference, iterations) + newest):
        subprocess.run(command, env=env, cwd=REPO, check=True, capture_output=True)
    assert [r["step"] for r in read_metrics(interrupted)] == list(range(1, iterations + 1))
    final = f"checkpoints/step-{iterations}"
    resumed, uninterrupted = (load_file(run / final / "actor" / "model.safetensors")
                              for run in (interrupted, reference))
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)
    (tensors, _), (reference_tensors, _) = (load_trainer_state(run / final) for run in (interrupted, reference))
    state, expected = tensors["actor_optimizer"]["state"], reference_tensors["actor_optimizer"]["state"]
    assert all(torch.equal(state[n]["exp_avg_sq"], expected[n]["exp_avg_sq"]) for n in expected)
    assert not (interrupted / f"checkpoints/step-{iterations - 1}" / OPTIMIZER_FILE).exists()
