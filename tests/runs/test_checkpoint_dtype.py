"""``checkpoint_dtype``: the weights on disk and what their config.json says about them agree (a loader with dtype
"auto" loads a bfloat16 checkpoint at half size); float16 -- storage only, no gradient is taken in it -- refuses a
weight beyond its range instead of writing inf; misspelt checkpoint and collapse settings get the closest value."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from stppo_agent.models.tiny import build_tiny_llama, toy_train_command, word_tokenizer
from stppo_agent.runs.checkpoint import list_checkpoints
from tests.support.cli_in_process import stppo


def train(model: Path, run: Path, iterations: int, *sets: str, capsys, resume: bool = False):
    return stppo(*toy_train_command(model, run, iterations, resume=resume, extra=("monitor.on_collapse=none",
                                                                                  *sets))[3:],
                 capsys=capsys)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_checkpoints_config_names_the_dtype_its_weights_are_stored_in(tiny_model, tmp_path, capsys, dtype):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    done = train(tiny_model, run, 1, f"checkpoint.dtype={dtype}", capsys=capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    step = run / "checkpoints" / "step-1"
    for model in ("actor", "critic"):
        assert json.loads((step / model / "config.json").read_text())["dtype"] == dtype
    loaded = AutoModelForCausalLM.from_pretrained(step / "actor", dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {getattr(torch, dtype)}
    plain = train(tiny_model, tmp_path / "plain", 1, capsys=capsys)  # no checkpoint_dtype: the weights' own
    assert plain.returncode == 0
    config = json.loads((tmp_path / "plain" / "checkpoints" / "step-1" / "actor" / "config.json").read_text())
    assert config["dtype"] == "float32"


def test_float16_refuses_a_weight_beyond_its_range_and_keeps_the_last_checkpoint(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    weights = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        weights.model.embed_tokens.weight[2] = 1e5  # <unk>'s row: no prompt of the toy env holds it
    weights.save_pretrained(model)
    run = tmp_path / "run"
    assert train(model, run, 1, capsys=capsys).returncode == 0
    refused = train(model, run, 2, "checkpoint.dtype=float16", capsys=capsys, resume=True)
    error = [line for line in refused.stderr.splitlines() if line.startswith("stppo train:")]
    assert refused.returncode == 1 and len(error) == 1, refused.stderr[-2000:]
    assert "checkpoint.dtype=float16 cannot hold the actor's model.embed_tokens.weight" in error[0]
    assert "checkpoint.dtype=bfloat16" in error[0]
    assert list_checkpoints(run) == [1] and not list((run / "checkpoints").glob(".step-*"))
    again = train(model, run, 2, "checkpoint.dtype=bfloat16", capsys=capsys, resume=True)
    assert again.returncode == 0, again.stderr[-2000:]


@pytest.mark.parametrize("setting, message", [
    ("monitor.on_collapse=rolback",
     "monitor.on_collapse must be one of none, warn, stop, rollback, got 'rolback' (did you mean rollback?)"),
    ("checkpoint.dtype=bfloat61", "checkpoint.dtype must be bfloat16, float16, float32 or null, got 'bfloat61' (did "
                                  "you mean bfloat16?)"),
    ("checkpoint.optimizer=newset", "checkpoint.optimizer must be all, newest or none, got 'newset' (did you mean "
                                    "newest?)"),
])
@pytest.mark.parametrize("command", ["train", "replay"])
def test_a_misspelt_setting_gets_the_closest_value_before_anything_loads(tmp_path, capsys, monkeypatch, setting,
                                                                         message, command):
    monkeypatch.setitem(sys.modules, "stppo_agent.training.trainer", None)  # importing it would fail the test
    if command == "train":
        words = ["train", "--algo", "ppo", "--env", "stppo/Toy-v0", "--model", "tiny", "--output-dir",
                 str(tmp_path / "run")]
    else:
        words = ["replay", str(tmp_path / "recorded"), "--output-dir", str(tmp_path / "replayed")]
    refused = stppo(*words, "--set", setting, capsys=capsys)
    assert refused.returncode == 1 and refused.stderr == f"stppo {command}: error: {message}\n"
