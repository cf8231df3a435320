"""Run folders never lose or mix runs: refusal without --resume/--overwrite, corrupt checkpoints and manifests,
torn metrics lines (issue 12)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stppo_agent.cli import main
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.runs.checkpoint import CorruptCheckpointError, list_checkpoints, verify_checkpoint
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.trainer import Trainer

from .test_trainer import toy_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


def config(model, out, iterations):
    # on_collapse=none: pruning then keeps exactly the newest keep_checkpoints (the collapse monitor also keeps a
    # healthy and a best checkpoint; tests/test_collapse.py covers that)
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
