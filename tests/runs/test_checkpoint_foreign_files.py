"""A checkpoint is what its manifest names: a file someone else put inside ``RUN/checkpoints/step-N`` does not make
it corrupt (``@latest`` still evaluates it, ``--resume`` still continues from it), and no stppo command writes
there."""

from __future__ import annotations

from pathlib import Path

import pytest

from stppo_agent.models.tiny import toy_train_command
from stppo_agent.runs.metrics_log import read_metrics
from tests.support.cli_in_process import stppo


def train(model: Path, run: Path, iterations: int, *sets: str, capsys, resume: bool = False):
    return stppo(*toy_train_command(model, run, iterations, resume=resume, extra=sets)[3:], capsys=capsys)


def evaluate(agent: str, out: Path, capsys):
    return stppo("eval", "--agent", agent, "--benchmarks", "nq", "--limit", "1", "--max-turns", "1",
                 "--max-new-tokens", "2", "--output-dir", str(out), capsys=capsys)


def test_files_written_inside_the_newest_checkpoint_leave_it_the_one_evaluated_and_resumed(tiny_model, tmp_path,
                                                                                          capsys):
    run = tmp_path / "run"
    newest = ("checkpoint.optimizer=newest",
              "monitor.on_collapse=none")  # only step-2 can resume: nothing to fall back on
    assert train(tiny_model, run, 2, *newest, capsys=capsys).returncode == 0
    step2 = run / "checkpoints" / "step-2"
    (step2 / "eval").mkdir()
    (step2 / "eval" / "results.json").write_text("[]\n")  # an evaluation's output, put there by hand
    (step2 / "NOTES.txt").write_text("looked fine\n")
    (step2 / "actor" / "README.md").write_text("# my model\n")  # not a file a loader reads

    done = evaluate(f"hf:{run}@latest", tmp_path / "eval", capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"hf:{run}@latest -> step-2: the newest checkpoint" in done.stdout

    resumed = train(tiny_model, run, 3, *newest, capsys=capsys, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {step2} (iteration 2" in resumed.stdout
    assert not list((run / "checkpoints").glob(".corrupt-*"))
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


def test_an_unlisted_weights_file_in_a_model_folder_still_makes_the_checkpoint_corrupt(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tiny_model, run, 2, "monitor.on_collapse=none", capsys=capsys).returncode == 0
    # from_pretrained reads the folder, not the manifest: a stray weights index there would load unverified
    (run / "checkpoints" / "step-2" / "actor" / "model.safetensors.index.json").write_text("{}")
    done = evaluate(f"hf:{run}@latest", tmp_path / "eval", capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "-> step-1: the newest checkpoint that verifies (the newer step-2 does not)" in done.stdout


@pytest.mark.parametrize("command", [
    ["eval", "--agent", "tiny-placeholder", "--benchmarks", "nq", "--output-dir", "{step}/eval"],
    ["eval", "--agent", "tiny-placeholder", "--benchmarks", "nq", "--output-dir", "{step}"],
    ["plot", "{run}", "--out", "{step}/actor/plots"],
    ["train", "--algo", "ppo", "--env", "stppo/Toy-v0", "--model", "tiny", "--output-dir", "{step}/again"],
])
def test_no_command_writes_inside_a_checkpoint(tiny_model, tmp_path, capsys, command):
    run = tmp_path / "run"
    assert train(tiny_model, run, 1, "monitor.on_collapse=none", capsys=capsys).returncode == 0
    step = run / "checkpoints" / "step-1"
    before = sorted(str(p.relative_to(step)) for p in step.rglob("*"))
    arguments = [word.format(run=run, step=step).replace("tiny-placeholder", f"hf:{run}@latest") for word in command]
    refused = stppo(*arguments, capsys=capsys)
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert f"is inside checkpoint step-1 of the run {run}" in refused.stderr and "Write to another folder" in \
        refused.stderr
    assert sorted(str(p.relative_to(step)) for p in step.rglob("*")) == before  # nothing written there
