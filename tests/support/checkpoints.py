"""Fake models and runs for the checkpoint and training-state tests: they save a small
state dict, so each test takes milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from stppo_agent.runs import checkpoint as ck


class FakeModel(torch.nn.Module):
    """A module that saves like a Hugging Face model (``save_pretrained``) and remembers what it was asked to save."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng():  # a checkpoint's own random state must not move
            torch.manual_seed(seed)
            self.layer = torch.nn.Linear(3, 2)
        self.saved: list[dict | None] = []

    def save_pretrained(self, path: Path, state_dict=None, safe_serialization=True):
        assert safe_serialization
        self.saved.append(state_dict)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(dict(state_dict if state_dict is not None else self.state_dict()), path / "weights.pt")


class FakeTokenizer:
    def save_pretrained(self, path: Path):
        (path / "tokenizer.json").write_text("{}")


def save(run: Path, step: int, *, keep: int = 5, config: dict | None = None, optimizer: bool = True,
         protect=(), actor=None, critic=None, **kwargs) -> Path:
    tensors = {"actor_scheduler": {"last_epoch": step}, "torch_rng": torch.arange(3)}
    if optimizer:
        tensors["actor_optimizer"] = {"m": torch.full((2,), float(step))}
        tensors["critic_optimizer"] = {"m": torch.full((2,), -float(step))}
    return ck.save_checkpoint(run, step, actor=actor or FakeModel(), tokenizer=FakeTokenizer(), critic=critic,
                              tensor_state=tensors, json_state={"iteration": step, "config": config or {}},
                              keep=keep, protect=protect, **kwargs)


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


# --- trainer state: what a checkpoint holds besides the weights, and a resume ---------------------------------


class FakeSource:
    def __init__(self, position: int):
        self.position, self.loaded = position, None

    def state(self):
        return {"position": self.position}

    def load(self, state):
        self.loaded = state


class FakeStale:
    def __init__(self):
        self.loaded = "never"

    def state(self, actor):
        return {"model": {"w": torch.full((2,), 3.0)}, "pending": [{"w": torch.full((2,), 4.0)}],
                "pending_from_actor": True, "aliases": {}}

    def load(self, state, actor):
        self.loaded = state


def fake_run(tmp_path: Path, critic: bool = True, **overrides):
    """(a training state of linear models after two schedule steps, at iteration 6, and the config it trains
    under)."""
    from stppo_agent.training.config import from_dict, merged
    from stppo_agent.training.state import TrainingState

    values = dict(algo="ppo" if critic else "grpo", env="stppo/Toy-v0", model="tiny-model",
                  output_dir=str(tmp_path / "run"), optimizer=dict(actor_lr=0.01, critic_lr=0.02, weight_decay=0.05),
                  logging=dict(progress=False, tensorboard=False))
    config = from_dict(merged(values, overrides))

    def models(lr):
        module = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        module(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        scheduler.step()
        scheduler.step()
        return module, optimizer, scheduler

    actor, actor_optimizer, actor_scheduler = models(config.optimizer.actor_lr * 0.25)
    critic_model, critic_optimizer, critic_scheduler = models(config.optimizer.critic_lr) if critic else (None, None,
                                                                                                          None)
    state = TrainingState(tokenizer=None, actor=actor, actor_optimizer=actor_optimizer, actor_scheduler=actor_scheduler,
                          stale_policy=FakeStale(), critic=critic_model, critic_optimizer=critic_optimizer,
                          critic_scheduler=critic_scheduler, iteration=6, optimizer_steps=13, nan_skips_total=2,
                          actor_lr_scale=0.25, sampler=FakeSource(42))
    return state, config


def checkpoint_of(run, folder: Path, step: int = 6) -> Path:
    state, config = run
    tensors, saved = state.states(config, config.algorithm_config())
    return ck.save_checkpoint(folder, step, actor=FakeModel(), tokenizer=FakeTokenizer(), critic=None,
                              tensor_state=tensors, json_state=saved, keep=3)


def resume(run, folder: Path) -> list[str]:
    """What the resume of ``run`` (state, config) from ``folder`` reported."""
    from stppo_agent.training.state import Restore

    state, config = run
    messages = []
    state.load(folder, config, config.algorithm_config(), Restore.RESUME, messages.append)
    return messages
