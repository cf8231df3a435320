"""A run's base model moved (its folder renamed, ``STPPO_CACHE_DIR`` changed): ``--resume --model NEWPATH`` accepts
a copy of the same weights (the checkpoint records their sha256) and refuses other weights; ``--resume`` alone
says the model is gone and what to pass, in one line, before any model loads."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from stppo_agent.models.tiny import build_tiny_llama, toy_train_command, word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics
from tests.support.cli_in_process import stppo

KL = ("algorithm.kl_in_reward=0.001",)  # the reference policy is the base model: a resume loads it


def arguments(model: Path | str | None, run: Path, iterations: int, resume: bool, kl: bool = True) -> list[str]:
    """``stppo train`` of the toy run, with ``--model model`` (None: without --model, as config.yaml says)."""
    words = toy_train_command(Path("MODEL"), run, iterations, resume=resume, extra=KL if kl else ())[3:]
    at = words.index("--model")
    return words[:at] + (["--model", str(model)] if model is not None else []) + words[at + 2:]


def test_a_moved_copy_of_the_base_model_is_accepted_and_other_weights_are_refused(tmp_path, capsys):
    first = build_tiny_llama(tmp_path / "models" / "base", word_tokenizer())
    run = tmp_path / "run"
    assert stppo(*arguments(first, run, 2, resume=False), capsys=capsys).returncode == 0
    moved = tmp_path / "elsewhere" / "base"
    moved.parent.mkdir()
    os.replace(first, moved)

    gone = stppo(*arguments(None, run, 3, resume=True), capsys=capsys)
    assert gone.returncode == 1 and gone.stderr.count("\n") == 1, gone.stderr
    assert f"the base model {first} does not exist" in gone.stderr and "pass --model" in gone.stderr

    other = build_tiny_llama(tmp_path / "models" / "other", word_tokenizer(), seed=1)
    refused = stppo(*arguments(other, run, 3, resume=True), capsys=capsys)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"cannot change model ({first} -> {other})" in refused.stderr and "is not a copy" in refused.stderr

    resumed = stppo(*arguments(moved, run, 3, resume=True), capsys=capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"base model {moved}: the same weights as {first}" in resumed.stdout
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert yaml.safe_load((run / "config.yaml").read_text())["model"] == str(moved)
    again = stppo(*arguments(None, run, 4, resume=True), capsys=capsys)  # config.yaml now names the new place
    assert again.returncode == 0, again.stderr[-2000:]


def test_tiny_rebuilt_under_another_cache_dir_resumes(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache-a"))
    assert stppo(*arguments("tiny", run, 1, resume=False), capsys=capsys).returncode == 0
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache-b"))
    resumed = stppo(*arguments("tiny", run, 2, resume=True), capsys=capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"the same weights as {tmp_path / 'cache-a'}" in resumed.stdout


def test_a_run_without_a_kl_reference_resumes_from_its_checkpoint_alone_after_the_model_moved(tmp_path, capsys):
    first = build_tiny_llama(tmp_path / "models" / "base", word_tokenizer())
    run = tmp_path / "run"
    assert stppo(*arguments(first, run, 1, resume=False, kl=False), capsys=capsys).returncode == 0
    os.replace(first, tmp_path / "moved")  # the actor and tokenizer a resume loads are the checkpoint's
    resumed = stppo(*arguments(None, run, 2, resume=True, kl=False), capsys=capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
