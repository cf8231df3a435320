"""The trainer learns on the toy env, fails when the math is broken, survives kill -9, NaNs and corrupt files."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from stppo_agent.algorithms import get_advantage_estimator, register_advantage_estimator
from stppo_agent.models.tiny import toy_train_command
from stppo_agent.runs.checkpoint import CorruptCheckpointError, load_trainer_state, valid_checkpoints
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.runs.run_folder import pick_checkpoint
from stppo_agent.training.ppo_update import TrainingDivergedError
from stppo_agent.training.trainer import Trainer
from tests.support.paths import REPO
from tests.support.processes import kill_9_once_written
from tests.support.runs import toy_config


def rewards(out: Path) -> list[float]:
    return [record["reward"] for record in read_metrics(out)]


@pytest.mark.parametrize("algo", ["ppo", "st_ppo", "grpo"])
def test_tiny_model_learns_the_toy_env(tiny_model, tmp_path, algo):
    Trainer(toy_config(tiny_model, tmp_path, algo)).train()
    curve = rewards(tmp_path)
    assert curve[0] < 0.4, curve  # chance: 1/9 per turn for an untrained model over a 9-token vocabulary
    assert sum(curve[-3:]) / 3 > 0.8, curve
    # healthy learning raises no collapse alarm (on_collapse=warn is the default); tripped single signals may happen
    assert not [r["step"] for r in read_metrics(tmp_path) if r.get("collapse/alarm")]
    last = read_metrics(tmp_path)[-1]
    for key in ("clip_frac", "turn_clip_frac", "ratio/mean", "approx_kl", "entropy", "grad_norm", "reward",
                "response_tokens", "turns", "search_calls", "invalid_action_rate", "answer_rate", "advantage/mean"):
        assert key in last, key
    if algo != "grpo":
        assert {"value_loss", "explained_variance"} <= set(last)
    if algo == "st_ppo":
        assert {"clip_bias_norm", "pg_grad_norm", "clip_bias_scale"} <= set(last)


def _negated_grpo(**kwargs):
    advantages, returns = get_advantage_estimator("grpo")(**kwargs)
    return -advantages, -returns


register_advantage_estimator("test_negated_grpo", _negated_grpo)


def test_learning_fails_when_the_advantage_sign_is_flipped(tiny_model, tmp_path):
    config = toy_config(tiny_model, tmp_path, "grpo")
    config.algorithm = dict(config.algorithm, advantage="test_negated_grpo")
    Trainer(config).train()
    assert sum(rewards(tmp_path)[-3:]) / 3 < 0.2


def test_learning_fails_when_the_loss_mask_is_off_by_one(tiny_model, tmp_path):
    def shift_mask(batch):  # the classic alignment bug: train on the token after each sampled one
        shifted = torch.zeros_like(batch.loss_mask)
        shifted[:, 1:] = batch.loss_mask[:, :-1]
        batch.loss_mask = shifted & batch.attention_mask[:, batch.prompt_width:].bool()
        batch.turn_ids = torch.where(batch.loss_mask, torch.zeros_like(batch.turn_ids), -1)

    Trainer(toy_config(tiny_model, tmp_path, "grpo"), batch_hook=shift_mask).train()
    assert sum(rewards(tmp_path)[-3:]) / 3 < 0.5


def test_nan_losses_are_skipped_then_stop_the_run(tiny_model, tmp_path):
    def poison(batch):
        batch.rewards[:] = float("nan")

    messages = []
    config = toy_config(tiny_model, tmp_path, "grpo", iterations=5, monitor=dict(max_nan_skips=2),
                        optimizer=dict(epochs=1, mini_batch_size=64, micro_batch_size=32))
    with pytest.raises(TrainingDivergedError, match="3 consecutive updates had NaN/inf"):
        Trainer(config, report=messages.append, batch_hook=poison).train()
    assert sum("update skipped" in m for m in messages) == 3


def test_checkpoint_is_a_plain_hf_folder_and_corruption_is_reported(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    Trainer(toy_config(tiny_model, tmp_path, "st_ppo", iterations=4, checkpoint=dict(every=2, keep=3))).train()
    step4 = tmp_path / "checkpoints" / "step-4"
    actor = AutoModelForCausalLM.from_pretrained(step4 / "actor")
    critic = AutoModelForTokenClassification.from_pretrained(step4 / "critic")
    assert actor.config.vocab_size == critic.config.vocab_size
    _, state = load_trainer_state(step4)
    assert state["iteration"] == 4 and state["optimizer_steps"] == 4 * 2 * 2
    weights = step4 / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
        load_trainer_state(step4)
    assert valid_checkpoints(tmp_path) == [2]  # step-4 no longer verifies
    folder, why = pick_checkpoint(tmp_path, "latest")
    assert folder.name == "step-2", why


def test_kill_9_then_resume_matches_an_uninterrupted_run(tiny_model, tmp_path):
    iterations = 12
    interrupted, reference = tmp_path / "interrupted", tmp_path / "reference"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(toy_train_command(tiny_model, interrupted, iterations), env=env, cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    kill_9_once_written(process, interrupted / "checkpoints" / "step-3")
    killed_at = max(int(p.name.split("-")[1]) for p in (interrupted / "checkpoints").glob("step-*"))
    assert killed_at < iterations, "the run finished before it could be killed; the test needs a longer run"

    subprocess.run(toy_train_command(tiny_model, interrupted, iterations, resume=True), env=env, cwd=REPO,
                   check=True, capture_output=True)
    subprocess.run(toy_train_command(tiny_model, reference, iterations), env=env, cwd=REPO, check=True,
                   capture_output=True)

    steps = [record["step"] for record in read_metrics(interrupted)]
    assert steps == list(range(1, iterations + 1))
    final = f"checkpoints/step-{iterations}"
    _, resumed_state = load_trainer_state(interrupted / final)
    _, reference_state = load_trainer_state(reference / final)
    for key in ("iteration", "optimizer_steps", "sampler"):
        assert resumed_state[key] == reference_state[key]
    from safetensors.torch import load_file

    resumed = load_file(interrupted / final / "actor" / "model.safetensors")
    uninterrupted = load_file(reference / final / "actor" / "model.safetensors")
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)
    tensors, _ = load_trainer_state(interrupted / final)
    reference_tensors, _ = load_trainer_state(reference / final)
    # optimizer state is keyed by parameter name (resumable under DDP or FSDP2, any number of processes)
    state, reference_state = tensors["actor_optimizer"]["state"], reference_tensors["actor_optimizer"]["state"]
    from transformers import AutoModelForCausalLM

    actor = AutoModelForCausalLM.from_pretrained(interrupted / final / "actor")
    assert set(state) == {name for name, _ in actor.named_parameters()}
    for name in reference_state:
        assert all(torch.equal(state[name][k], reference_state[name][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_metrics_file_is_json_lines(tiny_model, tmp_path):
    Trainer(toy_config(tiny_model, tmp_path, "grpo", iterations=2)).train()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert (tmp_path / "config.yaml").exists()


def test_bfloat16_and_gradient_checkpointing_options_train(tiny_model, tmp_path):
    config = toy_config(tiny_model, tmp_path, "st_ppo", iterations=2, precision=dict(dtype="bfloat16"),
                        optimizer=dict(gradient_checkpointing=True))
    trainer = Trainer(config)
    from stppo_agent.models.loading import is_checkpointing

    assert trainer.state.actor.dtype == torch.bfloat16 and is_checkpointing(trainer.state.actor)
    before = {n: p.detach().clone() for n, p in trainer.state.actor.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.state.actor.named_parameters())
    assert all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in read_metrics(tmp_path))


def test_train_command_reports_bad_input(tmp_path, capsys):
    from stppo_agent.cli import main

    assert main(["train", "--env", "stppo/Toy-v0", "--output-dir", str(tmp_path)]) == 1
    assert "model is required" in capsys.readouterr().err
    assert main(["train", "--model", str(tmp_path / "nothing"), "--env", "stppo/Toy-v0", "--output-dir",
                 str(tmp_path)]) == 1
    assert "cannot load a tokenizer from" in capsys.readouterr().err
    assert main(["train", "--model", "m", "--set", "algorithm.clip_hgh=0.3"]) == 1
    assert "unknown algorithm fields ['clip_hgh']" in capsys.readouterr().err


def test_entropy_bonus_changes_the_gradient(tiny_model, tmp_path):
    grads = []
    for coef in (0.0, 0.5):
        trainer = Trainer(toy_config(tiny_model, tmp_path / str(coef), "grpo",
                                     algorithm={"kl_loss_coef": 0.0, "entropy_coef": coef}))
        torch.manual_seed(0)
        batch = trainer.rollout()
        trainer.score(batch)
        metrics = trainer.actor_gradients(batch)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.state.actor.parameters()]))
        assert metrics["entropy"] > 0
    assert not torch.allclose(grads[0], grads[1])


def test_training_stops_when_searches_fail(tiny_model, tmp_path, monkeypatch):
    from stppo_agent.training import live_rollouts
    from stppo_envs.retrieval import RetrievalError

    real = live_rollouts.collect_rollouts

    def failing_searches(*args, **kwargs):  # what a dead retrieval server does to every search of a batch
        batch = real(*args, **kwargs)
        batch.stats["search_error_rate"] = 0.5
        return batch

    monkeypatch.setattr(live_rollouts, "collect_rollouts", failing_searches)
    with pytest.raises(RetrievalError, match="50% of the searches failed"):
        Trainer(toy_config(tiny_model, tmp_path, "ppo", iterations=2)).train()
    assert not read_metrics(tmp_path)  # nothing was trained on the broken batch
