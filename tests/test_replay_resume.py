"""``stppo replay`` into a folder that holds a run: refused with the flags replay itself takes; ``--resume``
continues an interrupted replay exactly where it stopped, ``--overwrite`` replaces it."""

from __future__ import annotations

from pathlib import Path

import pytest

from stppo_agent.cli import main
from stppo_agent.models.tiny import build_tiny_llama, toy_train_command, word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics

from .cli_in_process import stppo
from .test_replay import TIMING


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recorded")
    model = build_tiny_llama(root / "model", word_tokenizer())
    run = root / "run"
    assert main(toy_train_command(model, run, 3, extra=("logging.save_rollouts=true",
                                                        "monitor.on_collapse=none"))[3:]) == 0
    return run


def replay(recorded: Path, out: Path, *flags: str, capsys):
    return stppo("replay", str(recorded), "--output-dir", str(out), *flags, capsys=capsys)


def test_an_interrupted_replay_resumes_to_what_an_uninterrupted_one_logs(recorded, tmp_path, capsys):
    whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
    assert replay(recorded, whole, capsys=capsys).returncode == 0
    assert replay(recorded, interrupted, "--iterations", "2", capsys=capsys).returncode == 0

    refused = replay(recorded, interrupted, capsys=capsys)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "already holds a run" in refused.stderr and "--resume" in refused.stderr and "--overwrite" in refused.stderr

    resumed = replay(recorded, interrupted, "--resume", capsys=capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {interrupted / 'checkpoints' / 'step-2'}" in resumed.stdout
    expected, got = read_metrics(whole), read_metrics(interrupted)
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(expected, got):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
    assert [r["step"] for r in read_metrics(interrupted, "steps.jsonl")] == \
        [r["step"] for r in read_metrics(whole, "steps.jsonl")]


def test_overwrite_replaces_a_replay(recorded, tmp_path, capsys):
    out = tmp_path / "out"
    assert replay(recorded, out, capsys=capsys).returncode == 0
    again = replay(recorded, out, "--overwrite", "--iterations", "1", capsys=capsys)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [r["step"] for r in read_metrics(out)] == [1]
    both = replay(recorded, out, "--resume", "--overwrite", capsys=capsys)
    assert both.returncode == 1 and "pass one" in both.stderr
