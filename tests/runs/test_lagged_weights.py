"""What ``rollout_staleness: K`` adds to a checkpoint: K copies of the actor in ``lagged_policy.safetensors`` (the
newest queued weights are the checkpoint's own actor), tied tensors once, in ``checkpoint_dtype``, and only in the
newest checkpoint under ``checkpoint_optimizer=newest``; ``trainer_state.pt`` stays a few kB. A resume continues
the lag from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from stppo_agent.models.tiny import build_tiny_llama, toy_train_command, word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics
from tests.support.cli_in_process import stppo

LAGGED = "lagged_policy.safetensors"


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:  # an output head sharing the embedding matrix, as in SmolLM2
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer(), tied=True)


def train(model: Path, run: Path, iterations: int, *sets: str, capsys, resume: bool = False):
    done = stppo(*toy_train_command(model, run, iterations, resume=resume,
                                    extra=("rollout.staleness=2", "monitor.on_collapse=none", "checkpoint.keep=3",
                                           *sets))[3:],
                 capsys=capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def copies(checkpoint: Path) -> tuple[int, set[torch.dtype], dict[str, str]]:
    """(whole copies of the actor the lagged file holds, their dtypes, its metadata)."""
    with safe_open(str(checkpoint / LAGGED), framework="pt") as handle:
        keys, metadata = list(handle.keys()), handle.metadata()
        dtypes = {handle.get_tensor(key).dtype for key in keys}
    with safe_open(str(checkpoint / "actor" / "model.safetensors"), framework="pt") as handle:
        per_copy = len(list(handle.keys()))
    return len(keys) // per_copy, dtypes, metadata


def test_staleness_2_stores_two_copies_of_the_actor_and_a_small_trainer_state(tied_model, tmp_path, capsys):
    run = tmp_path / "run"
    train(tied_model, run, 4, capsys=capsys)
    step = run / "checkpoints" / "step-4"
    count, dtypes, metadata = copies(step)
    assert count == 2 and dtypes == {torch.float32}  # the generator (after 2 updates) and the weights after 3
    assert metadata["pending"] == "1" and metadata["pending_from_actor"] == "1"
    assert json.loads(metadata["aliases"]) == {"lm_head.weight": "model.embed_tokens.weight"}  # stored once
    actor = (step / "actor" / "model.safetensors").stat().st_size
    assert 2 * actor - 8192 <= (step / LAGGED).stat().st_size <= 2 * actor + 8192
    assert (step / "trainer_state.pt").stat().st_size < 32_000  # schedules and random streams only
    assert LAGGED in json.loads((step / "manifest.json").read_text())


def test_with_bfloat16_and_newest_the_copies_are_half_size_and_only_in_the_newest(tied_model, tmp_path, capsys):
    run = tmp_path / "run"
    small = ("checkpoint.dtype=bfloat16", "checkpoint.optimizer=newest")
    train(tied_model, run, 4, *small, capsys=capsys)
    newest = run / "checkpoints" / "step-4"
    count, dtypes, _ = copies(newest)
    assert count == 2 and dtypes == {torch.bfloat16}
    assert (newest / LAGGED).stat().st_size <= (newest / "actor" / "model.safetensors").stat().st_size * 2 + 8192
    for older in ("step-2", "step-3"):  # dropped with the optimizer state: an older checkpoint cannot resume
        folder = run / "checkpoints" / older
        assert not (folder / LAGGED).exists() and LAGGED not in json.loads((folder / "manifest.json").read_text())
    resumed = train(tied_model, run, 6, *small, capsys=capsys, resume=True)
    assert "resumed from" in resumed.stdout
    assert [r["staleness"] for r in read_metrics(run)] == [0, 1, 2, 2, 2, 2]
    assert not (run / "checkpoints" / "step-4" / LAGGED).exists() and (run / "checkpoints" / "step-6" / LAGGED).exists()
