"""``stppo_agent.runs.run_folder``: run folders never lose or mix runs -- refusal
without --resume/--overwrite, corrupt checkpoints and manifests, torn metrics lines, picking a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stppo_agent.cli import main
from stppo_agent.distributed import process_group
from stppo_agent.runs import run_folder
from stppo_agent.runs.checkpoint import CorruptCheckpointError, _write_manifest, list_checkpoints, verify_checkpoint
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.trainer import Trainer
from tests.support.runs import toy_config


# -- run_folder ----------------------------------------------------------------------------------------------------
def checkpoint(run: Path, step: int, payload: bytes = b"weights") -> Path:
    folder = run / "checkpoints" / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "actor.bin").write_bytes(payload)
    _write_manifest(folder)
    return folder


def corrupt(folder: Path) -> None:
    (folder / "actor.bin").write_bytes(b"edited")


def test_run_folder_holds_a_run_with_metrics_or_checkpoints_and_describes_it(tmp_path):
    assert not run_folder.holds_run(tmp_path) and not run_folder.holds_run(tmp_path / "missing")
    assert run_folder.describe(tmp_path) == "0 checkpoint(s), 0 metrics record(s)"
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n  \n{"step": 2}\n')
    assert run_folder.holds_run(tmp_path)
    assert run_folder.describe(tmp_path) == "0 checkpoint(s), 2 metrics record(s)"
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2, "q": "\xc3')  # torn inside a character
    assert run_folder.describe(tmp_path) == "0 checkpoint(s), 2 metrics record(s)"
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    assert not run_folder.holds_run(other)
    checkpoint(other, 2)
    checkpoint(other, 10)
    assert run_folder.holds_run(other)
    assert run_folder.describe(other) == "2 checkpoint(s) (steps 2, 10), 0 metrics record(s)"


def test_run_folder_prepare_refuses_mixing_and_overwrite_removes_exactly_the_runs_files(tmp_path):
    notes = []
    with pytest.raises(ValueError, match=r"^--resume continues the run in the folder and --overwrite replaces it: "
                                         r"pass one$"):
        run_folder.prepare(tmp_path / "none", resume=True, overwrite=True, report=notes.append)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match=r"^output dir .*/file is a file$"):
        run_folder.prepare(tmp_path / "file", resume=False, overwrite=False, report=notes.append)
    empty = tmp_path / "empty"
    assert run_folder.prepare(empty, resume=False, overwrite=False, report=notes.append) is None and notes == []
    assert run_folder.prepare(empty, resume=False, overwrite=True, report=notes.append) is None and notes == []
    assert run_folder.prepare(empty, resume=True, overwrite=False, report=notes.append) is None
    assert notes == [f"--resume: {empty} holds no run yet; starting one"]

    run = tmp_path / "run"
    checkpoint(run, 1)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(FileExistsError) as caught:
        run_folder.prepare(run, resume=False, overwrite=False, report=notes.append)
    assert str(caught.value) == (f"{run} already holds a run (1 checkpoint(s) (steps 1), 1 metrics record(s)); pass "
                                 "--resume to continue it, --overwrite to replace it, or choose another --output-dir")
    for name in ("steps.jsonl", "config.yaml", "replay.json", "notes.txt"):
        (run / name).write_text("x")
    for name in ("rollouts", "tensorboard", "eval"):
        (run / name / "inner").mkdir(parents=True)
    assert run_folder.prepare(run, resume=False, overwrite=True, report=notes.append) is None
    assert notes[-1] == f"--overwrite: removing the run in {run} (1 checkpoint(s) (steps 1), 1 metrics record(s))"
    assert sorted(p.name for p in run.iterdir()) == ["eval", "notes.txt"]  # not the run's: kept


def test_run_folder_resume_takes_the_newest_checkpoint_that_verifies(tmp_path):
    notes = []
    run = tmp_path / "run"
    for step in (1, 2, 3):
        checkpoint(run, step)
    assert run_folder.prepare(run, resume=True, overwrite=False, report=notes.append) == run / "checkpoints" / "step-3"
    assert notes == []
    corrupt(run / "checkpoints" / "step-3")
    corrupt(run / "checkpoints" / "step-2")
    assert run_folder.prepare(run, resume=True, overwrite=False, report=notes.append) == run / "checkpoints" / "step-1"
    assert notes == [f"skipping corrupt checkpoint (moved to .corrupt-step-3): {run}/checkpoints/step-3: actor.bin "
                     "does not match its checksum (corrupt or edited)",
                     f"skipping corrupt checkpoint (moved to .corrupt-step-2): {run}/checkpoints/step-2: actor.bin "
                     "does not match its checksum (corrupt or edited)"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [".corrupt-step-2", ".corrupt-step-3", "step-1"]
    corrupt(run / "checkpoints" / "step-1")
    with pytest.raises(CorruptCheckpointError) as caught:
        run_folder.prepare(run, resume=True, overwrite=False, report=notes.append)
    assert str(caught.value) == (f"--resume: nothing in {run} can be resumed: {run}/checkpoints/step-1: actor.bin "
                                 "does not match its checksum (corrupt or edited). Starting over would mix two runs "
                                 "in one folder: pass --overwrite to start again there, or another --output-dir")
    two = tmp_path / "two"
    for step in (1, 2):
        corrupt(checkpoint(two, step))
    with pytest.raises(CorruptCheckpointError, match=(r"can be resumed: .*step-2: actor.bin does not match its "
                                                      r"checksum \(corrupt or edited\); .*step-1: actor.bin does not "
                                                      r"match its checksum \(corrupt or edited\)\. Starting over")):
        run_folder.prepare(two, resume=True, overwrite=False, report=notes.append)
    metrics_only = tmp_path / "metrics_only"
    metrics_only.mkdir()
    (metrics_only / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(CorruptCheckpointError, match=r"^--resume: nothing in .* can be resumed: no checkpoint at all "
                                                     r"\(the run stopped before its first save\)\. Starting over"):
        run_folder.prepare(metrics_only, resume=True, overwrite=False, report=notes.append)


def test_run_folder_prepare_on_all_ranks_runs_on_the_first_process_and_shares_its_verdict(tmp_path, monkeypatch):
    run = tmp_path / "run"
    checkpoint(run, 4)
    notes = []
    assert run_folder.prepare_on_all_ranks(run, resume=True, overwrite=False, report=notes.append) == (
        run / "checkpoints" / "step-4")
    with pytest.raises(FileExistsError, match="already holds a run"):
        run_folder.prepare_on_all_ranks(run, resume=False, overwrite=False)
    with pytest.raises(ValueError, match="pass one"):
        run_folder.prepare_on_all_ranks(run, resume=True, overwrite=True)
    corrupt(run / "checkpoints" / "step-4")
    with pytest.raises(CorruptCheckpointError, match="nothing in"):
        run_folder.prepare_on_all_ranks(run, resume=True, overwrite=False, report=notes.append)
    assert notes == [f"skipping corrupt checkpoint (moved to .corrupt-step-4): {run}/checkpoints/step-4: actor.bin "
                     "does not match its checksum (corrupt or edited)"]
    sent = []
    monkeypatch.setattr(process_group, "is_main", lambda: False)
    monkeypatch.setattr(process_group, "all_gather_objects", lambda value: sent.append(value) or ["rank 0's", value])
    assert run_folder.prepare_on_all_ranks(tmp_path / "x", resume=True, overwrite=True) == "rank 0's"
    assert sent == [None]  # this rank did not look at the folder
    monkeypatch.setattr(process_group, "all_gather_objects", lambda value: [FileExistsError("from rank 0"), value])
    with pytest.raises(FileExistsError, match="^from rank 0$"):
        run_folder.prepare_on_all_ranks(tmp_path / "x", resume=False, overwrite=False)


def test_run_folder_is_run_folder_only_with_checkpoints_and_no_model_config(tmp_path):
    assert not run_folder.is_run_folder(tmp_path / "missing")
    (tmp_path / "checkpoints").write_text("")
    assert not run_folder.is_run_folder(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert run_folder.is_run_folder(run)
    (run / "config.json").write_text("{}")  # a Hugging Face model folder
    assert not run_folder.is_run_folder(run)
    assert run_folder.CHECKPOINT_CHOICES == ("latest", "best", "healthy")


def monitored_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    for step in (1, 2, 3, 4):
        checkpoint(run, step)
    records = [{"step": 1, "reward": 0.1, "collapse/tripped": 0}, {"step": 2, "reward": 0.9, "collapse/tripped": 0},
               {"step": 3, "reward": 0.5, "collapse/tripped": 0}, {"step": 4, "reward": 0.2, "collapse/tripped": 0},
               {"step": 5, "reward": 0.3, "collapse/tripped": 1}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_run_folder_pick_checkpoint_by_name(tmp_path):
    run = monitored_run(tmp_path)
    steps = run / "checkpoints"
    assert run_folder.pick_checkpoint(run) == (steps / "step-4", "step-4: the newest checkpoint")
    assert run_folder.pick_checkpoint(run, "best") == (
        steps / "step-1", "step-1: the healthy checkpoint with the highest training reward (0.900, iteration 2's "
                          "rollouts: its weights sampled)")
    assert run_folder.pick_checkpoint(run, "healthy") == (steps / "step-3", "step-3: the newest healthy checkpoint")
    assert run_folder.pick_checkpoint(run, "3") == (steps / "step-3", "step-3: as asked")
    with pytest.raises(ValueError) as caught:
        run_folder.pick_checkpoint(run, "7")
    assert str(caught.value) == f"{run}@7: choose @latest, @best, @healthy or one of the steps 1, 2, 3, 4"
    with pytest.raises(ValueError, match="@newest: choose"):
        run_folder.pick_checkpoint(run, "newest")
    corrupt(steps / "step-4")
    assert run_folder.pick_checkpoint(run) == (  # the newest that verifies, saying so
        steps / "step-3", "step-3: the newest checkpoint that verifies (the newer step-4 does not)")
    records = read_metrics(run)
    for record in records:
        record["collapse/tripped"] = 1
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for which in ("best", "healthy"):
        with pytest.raises(FileNotFoundError) as caught:
            run_folder.pick_checkpoint(run, which)
        assert str(caught.value) == (f"{run}: no checkpoint is known healthy (kept: steps 1, 2, 3); a healthy one "
                                     "needs its iteration and the one its weights sampled logged without a collapse "
                                     "signal. Use @latest or @STEP")
    with pytest.raises(FileNotFoundError, match=r"^/.* has no checkpoint that verifies$"):
        run_folder.pick_checkpoint(tmp_path / "empty")


def test_run_folder_pick_checkpoint_of_an_unmonitored_run(tmp_path):
    run = tmp_path / "run"
    for step in (1, 2, 3):
        checkpoint(run, step)
    (run / "metrics.jsonl").write_text('{"step": 1, "reward": 0.4}\n{"step": 2, "reward": 0.8}\n'
                                       '{"step": 3, "reward": 0.1}\n')
    assert run_folder.pick_checkpoint(run, "best") == (
        run / "checkpoints" / "step-1", "step-1: the checkpoint with the highest training reward (0.800, iteration "
                                        "2's rollouts: its weights sampled); the run was not monitored "
                                        "(monitor.on_collapse=none), so its health is unknown")
    with pytest.raises(FileNotFoundError) as caught:
        run_folder.pick_checkpoint(run, "healthy")
    assert str(caught.value) == (f"{run} was trained with monitor.on_collapse=none: no collapse monitor judged its "
                                 "iterations, so no checkpoint is known healthy. Use @best, @latest or @STEP")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.4}\n')
    with pytest.raises(FileNotFoundError) as caught:
        run_folder.pick_checkpoint(run, "best")
    assert str(caught.value) == f"{run}: no kept checkpoint has a logged training reward. Use @latest or @STEP"
    (run / "metrics.jsonl").unlink()  # no records: judged as a monitored run with nothing healthy
    with pytest.raises(FileNotFoundError, match="no checkpoint is known healthy"):
        run_folder.pick_checkpoint(run, "best")
    assert run_folder.pick_checkpoint(run, "2")[1] == "step-2: as asked"


# Run folders never lose or mix runs: refusal without --resume/--overwrite, corrupt checkpoints and manifests, torn
# metrics lines.


def config(model, out, iterations):
    # on_collapse=none: pruning then keeps exactly the newest keep_checkpoints (the collapse monitor also keeps a
    # healthy and a best checkpoint; tests/monitoring/test_collapse_early_warning.py covers that)
    return toy_config(model, out, "ppo", iterations=iterations, checkpoint=dict(every=1, keep=2),
                      rollout=dict(prompts_per_iteration=2, samples_per_prompt=2),
                      optimizer=dict(mini_batch_size=4, micro_batch_size=2), monitor=dict(on_collapse="none"))


def test_a_folder_holding_a_run_is_refused_without_resume_or_overwrite(tiny_model, tmp_path):
    Trainer(config(tiny_model, tmp_path, 3)).train()
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(FileExistsError, match="already holds a run .2 checkpoint.*steps 2, 3.*--resume.*--overwrite"):
        Trainer(config(tiny_model, tmp_path, 2))
    assert (tmp_path / "metrics.jsonl").read_text() == before and list_checkpoints(tmp_path) == [2, 3]
    messages = []
    Trainer(config(tiny_model, tmp_path, 2), overwrite=True, report=messages.append).train()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert list_checkpoints(tmp_path) == [1, 2]  # the old run's step-3 is gone, not kept over the new run
    assert any("--overwrite: removing" in m for m in messages)
    with pytest.raises(ValueError, match="pass one"):
        Trainer(config(tiny_model, tmp_path, 2), resume=True, overwrite=True)
    assert main(["train", "--algo", "ppo", "--env", "stppo/Toy-v0", "--model", str(tiny_model), "--output-dir",
                 str(tmp_path), "--iterations", "1"]) == 1


def test_resume_with_every_checkpoint_corrupt_stops_and_says_what_it_found(tiny_model, tmp_path):
    Trainer(config(tiny_model, tmp_path, 2)).train()
    for step in (1, 2):
        weights = tmp_path / "checkpoints" / f"step-{step}" / "actor" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])  # truncated
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(CorruptCheckpointError, match="nothing in .* can be resumed.*does not match its checksum"):
        Trainer(config(tiny_model, tmp_path, 4), resume=True)
    assert (tmp_path / "metrics.jsonl").read_text() == before  # nothing lost
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [".corrupt-step-1", ".corrupt-step-2"]


def test_a_corrupt_newest_checkpoint_is_set_aside_and_never_pruned_over_the_resumed_run(tiny_model, tmp_path):
    Trainer(config(tiny_model, tmp_path, 3)).train()
    (tmp_path / "checkpoints" / "step-3" / "trainer_state.json").write_text("{}")
    messages = []
    Trainer(config(tiny_model, tmp_path, 5), resume=True, report=messages.append).train()
    assert any("skipping corrupt checkpoint" in m for m in messages)
    assert list_checkpoints(tmp_path) == [4, 5]  # resumed from 2: 3, 4, 5 were redone
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]


def test_a_torn_last_metrics_line_is_dropped_on_resume(tiny_model, tmp_path):
    Trainer(config(tiny_model, tmp_path, 2)).train()
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "reward": 0.')  # kill -9 during a write
    messages = []
    Trainer(config(tiny_model, tmp_path, 3), resume=True, report=messages.append).train()
    assert any("dropped a torn last record (line 3" in m for m in messages)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    lines.insert(1, "not json")  # corruption in the middle is not an interrupted write: named, not guessed
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl, line 2 is not JSON"):
        Trainer(config(tiny_model, tmp_path, 4), resume=True)


@pytest.mark.parametrize("manifest", ["[]", "{}", '{"actor/config.json": 3}', "not json"])
def test_manifests_that_do_not_vouch_for_every_file_are_corrupt(tiny_model, tmp_path, manifest):
    Trainer(config(tiny_model, tmp_path, 1)).train()
    folder = tmp_path / "checkpoints" / "step-1"
    verify_checkpoint(folder)
    (folder / "manifest.json").write_text(manifest)
    with pytest.raises(CorruptCheckpointError, match="manifest.json"):
        verify_checkpoint(folder)


def test_a_manifest_missing_one_file_is_corrupt(tiny_model, tmp_path):
    Trainer(config(tiny_model, tmp_path, 1)).train()
    folder = tmp_path / "checkpoints" / "step-1"
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["actor/model.safetensors"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match="does not list actor/model.safetensors"):
        verify_checkpoint(folder)


def test_a_checkpoint_that_cannot_be_written_says_why_and_keeps_the_last_good_one(tiny_model, tmp_path, monkeypatch,
                                                                                capsys):
    # a full disk: safetensors raises its own error type (not OSError) halfway through the weights
    import transformers

    Trainer(config(tiny_model, tmp_path, 1)).train()
    save = transformers.PreTrainedModel.save_pretrained

    def disk_full(self, folder, *args, **kwargs):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 1000)  # what got written before the disk filled
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", disk_full)
    before = (tmp_path / "metrics.jsonl").read_text()
    code = main(["train", "--algo", "ppo", "--env", "stppo/Toy-v0", "--model", str(tiny_model), "--output-dir",
                 str(tmp_path), "--iterations", "2", "--resume", "--set", "checkpoint.every=1", "--set",
                 "monitor.on_collapse=none",
                 "--set", "rollout.prompts_per_iteration=2", "--set", "rollout.samples_per_prompt=2", "--set",
                 "optimizer.mini_batch_size=4",
                 "--set", "optimizer.micro_batch_size=2", "--set", "logging.progress=false", "--set",
                 "logging.tensorboard=false"])
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("stppo train:")]
    assert code == 1 and len(error) == 1, error  # one line (progress bars of the loading aside)
    error = error[0]
    assert "No space left on device" in error and "step-1, is intact" in error and "--resume" in error
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]  # no partial copy left
    verify_checkpoint(tmp_path / "checkpoints" / "step-1")
    assert (tmp_path / "metrics.jsonl").read_text().startswith(before)
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save)
    Trainer(config(tiny_model, tmp_path, 2), resume=True).train()  # space again: the run goes on
    assert list_checkpoints(tmp_path) == [1, 2]
