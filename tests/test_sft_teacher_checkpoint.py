"""`stppo sft --teacher hf:RUN@latest|@STEP` (as its help lists) plays the run's checkpoint, resolved as `stppo eval`
resolves it, and says which; never a hub repo-id error."""

from __future__ import annotations

import pytest

from .cli_in_process import stppo


@pytest.fixture
def run(tmp_path, monkeypatch, capsys):
    """A training run with checkpoints at steps 1 and 2 (the built-in tiny model on the toy env)."""
    monkeypatch.chdir(tmp_path)
    trained = stppo("train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", "tiny", "--output-dir", "run",
                    "--iterations", "2", "--set", "rollout.samples_per_prompt=2", "--set",
                    "rollout.prompts_per_iteration=2",
                    "--set", "rollout.max_new_tokens_per_turn=1", "--set", "checkpoint.every=1", "--set",
                    "logging.tensorboard=false",
                    "--set", "logging.progress=false", capsys=capsys)
    assert trained.returncode == 0, trained.stderr[-2000:]
    return "run"


@pytest.mark.parametrize("which, step, why", [("latest", 2, "the newest checkpoint"), ("1", 1, "as asked")])
def test_a_checkpoint_of_a_run_teaches(run, capsys, which, step, why):
    done = stppo("sft", "--model", "tiny", "--teacher", f"hf:{run}@{which}", "--benchmarks", "nq", "--limit", "2",
                 "--max-turns", "2", "--steps", "1", "--output-dir", "warm", capsys=capsys)
    assert f"teacher hf:{run}@{which} -> step-{step}: {why}" in done.stdout.splitlines()
    # the toy-env model never answers an nq question, so it is refused for that, by the checkpoint it played
    assert (done.returncode, done.stderr.splitlines()[-1]) == (
        1, f"stppo sft: error: the teacher 'hf:{run}/checkpoints/step-{step}/actor' earned no reward on nq: no "
           "demonstrations to learn from")
