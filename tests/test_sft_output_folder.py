"""`stppo sft --output-dir`: refused before the teacher plays when it cannot be written or holds a training run,
another model or anything else; an earlier `stppo sft` model there is replaced whole, and a save that fails part-way
leaves it as it was."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from .cli_in_process import stppo
from .recording_agent import recording_agent, was_built


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """The current folder, where the commands write; the teacher plugin lives beside it."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.fixture
def teacher(tmp_path) -> Path:
    return recording_agent(tmp_path, "recording-teacher", "GoldSearchAgent")


def sft(capsys, out: str, *options: str):
    return stppo("sft", "--model", "tiny", "--benchmarks", "nq", "--limit", "2", "--steps", "1", "--batch-size", "1",
                 "--output-dir", out, *options, capsys=capsys)


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def make_run(folder: Path) -> None:
    (folder / "checkpoints" / "step-2" / "actor").mkdir(parents=True)
    (folder / "checkpoints" / "step-2" / "actor" / "config.json").write_text("{}")
    (folder / "config.yaml").write_text("algo: st_ppo\n")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')


def make_model(folder: Path) -> None:
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"weights")


def make_other(folder: Path) -> None:
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me\n")


@pytest.mark.parametrize("make, message", [
    (make_run, "--output-dir target holds a training run (checkpoints/, config.yaml, metrics.jsonl (2 records)); "
               "stppo sft writes a model folder: choose a new or empty one"),
    (make_model, "--output-dir target holds another model (config.json; no sft.json of stppo sft); choose a new or "
                 "empty folder"),
    (make_other, "--output-dir target is not empty (notes.txt) and holds no earlier stppo sft model; choose a new or "
                 "empty folder"),
    (lambda path: path.write_text("a file\n"), "--output-dir target is a file; choose a new or empty folder"),
])
def test_a_folder_holding_something_else_is_refused_before_the_teacher_plays(folder, teacher, capsys, make, message):
    make(folder / "target")
    before = contents(folder)
    done = sft(capsys, "target", "--teacher", "recording-teacher", "--import", str(teacher))
    assert (done.returncode, done.stderr) == (1, f"stppo sft: error: {message}\n")
    assert not was_built(teacher)
    assert contents(folder) == before  # nothing written into it, nothing beside it


def test_a_folder_that_cannot_be_written_is_refused_before_the_teacher_plays(folder, teacher, capsys):
    (folder / "notes.txt").write_text("a file\n")
    done = sft(capsys, "notes.txt/warm", "--teacher", "recording-teacher", "--import", str(teacher))
    assert (done.returncode, done.stderr) == (1, "stppo sft: error: --output-dir notes.txt/warm cannot be a folder: "
                                                 "notes.txt is a file; choose another --output-dir\n")
    assert not was_built(teacher)


def test_an_earlier_sft_model_is_replaced_whole_and_a_failed_save_leaves_it_whole(folder, capsys, monkeypatch):
    (folder / "warm").mkdir()  # an empty folder is taken
    assert sft(capsys, "warm").returncode == 0
    assert sft(capsys, "warm", "--seed", "3").returncode == 0  # an earlier sft output: replaced
    assert json.loads((folder / "warm" / "sft.json").read_text())["config"]["seed"] == 3
    first = contents(folder / "warm")

    from transformers import PreTrainedTokenizerBase

    def disk_full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)  # after the weights were saved
    failed = sft(capsys, "warm", "--lr", "0.01")  # other weights, had they been saved
    assert failed.returncode == 1 and "No space left on device" in failed.stderr
    assert contents(folder / "warm") == first
    assert sorted(p.name for p in folder.iterdir()) == ["warm"]  # no partial folder left beside it
