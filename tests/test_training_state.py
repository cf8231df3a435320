"""The training state's one save/load pair: a resume puts back everything a checkpoint holds, bit for bit (the
state saved again equals the state saved), and a rollback puts back the weights, the optimizers and the lagged
generator at the run's lowered learning rate while the counters, the prompt position and the random streams go on."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.runs.checkpoint import load_trainer_state
from stppo_agent.training.config import TrainConfig, from_dict, merged
from stppo_agent.training.live_rollouts import PromptSampler
from stppo_agent.training.model_setup import build_state
from stppo_agent.training.state import Restore, TrainingState


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer(), hidden=8, layers=1)


def run_config(model: Path, out: Path, **overrides) -> TrainConfig:
    values = dict(algo="ppo", env="stppo/Toy-v0", model=str(model), output_dir=str(out),
                  algorithm={"kl_in_reward": 0.0, "kl_loss_coef": 0.0}, rollout=dict(staleness=1),
                  optimizer=dict(actor_lr=1e-2, critic_lr=2e-2, warmup_steps=4),
                  logging=dict(progress=False, tensorboard=False))
    values = merged(values, overrides)
    return from_dict(values)


def state_of(config: TrainConfig, checkpoint: Path | None = None) -> TrainingState:
    state = build_state(config, config.algorithm_config(), torch.device("cpu"), False, checkpoint, report=print)
    state.sampler = PromptSampler([5, 3], seed=config.seed)
    return state


def trained(state: TrainingState, steps: int = 3) -> TrainingState:
    """``steps`` optimizer steps of both models on arbitrary losses, the lag advanced, counters and the prompt
    position moved."""
    ids = torch.tensor([[3, 4, 5, 6]])
    for _ in range(steps):
        for model, optimizer, scheduler in ((state.actor, state.actor_optimizer, state.actor_scheduler),
                                            (state.critic, state.critic_optimizer, state.critic_scheduler)):
            optimizer.zero_grad()
            model(input_ids=ids).logits.float().pow(2).mean().backward()
            optimizer.step()
            scheduler.step()
        state.stale_policy.advance(state.actor)
        state.iteration += 1
        state.optimizer_steps += 1
    state.nan_skips_total, state.actor_lr_scale = 2, 0.5
    state.sampler.take(4)
    return state


def differences(a, b, where: str = "") -> list[str]:
    """Where nested states (dicts, lists, tuples of tensors and plain values) differ, bit for bit (a list and a
    tuple of equal items are equal: a state loaded from disk holds lists)."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [where]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [where]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}/{i}")]
    return [] if a == b else [where]


def equal(a, b) -> bool:
    return not differences(a, b)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_a_resumed_state_saves_what_the_saved_one_saved(tiny_model, tmp_path):
    config = run_config(tiny_model, tmp_path / "run")
    algo = config.algorithm_config()
    saved = trained(state_of(config))
    saved.apply_learning_rates(config)  # a rollback's scale is in the rates when it is saved
    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)
    folder = saved.save(tmp_path / "run", config, algo, sharded=False)
    assert folder == tmp_path / "run" / "checkpoints" / "step-3"
    before = saved.states(config, algo)  # the streams are as they were at the save
    draws = (torch.rand(2).tolist(), random.random(), float(np.random.rand()))

    resumed = state_of(config, folder)  # the models are built from the checkpoint, as a resume builds them
    assert (resumed.iteration, resumed.optimizer_steps, resumed.actor_lr_scale) == (0, 0, 1.0)
    torch.manual_seed(0)
    messages = []
    resumed.load(folder, config, algo, Restore.RESUME, messages.append)
    assert (torch.rand(2).tolist(), random.random(), float(np.random.rand())) == draws
    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)
    after = resumed.states(config, algo)
    assert differences(after[0], before[0]) == []  # optimizers, schedules, lagged generator, torch streams
    assert after[1] == before[1]  # counters, prompt position, Python / NumPy streams, config, scale
    assert (resumed.iteration, resumed.optimizer_steps, resumed.nan_skips_total) == (3, 3, 2)
    assert resumed.sampler.state() == saved.sampler.state() == {"epoch": 0, "cursor": 4}
    assert resumed.actor_lr_scale == 0.5 and resumed.nan_skips_in_a_row == 0  # not saved: counted afresh
    assert equal(weights(resumed.actor), weights(saved.actor)) and equal(weights(resumed.critic), weights(saved.critic))
    assert equal(weights(resumed.stale_policy.model), weights(saved.stale_policy.model))
    assert resumed.actor_optimizer.param_groups[0]["lr"] == saved.actor_optimizer.param_groups[0]["lr"]
    assert messages[0] == f"resumed from {folder} (iteration 3, 3 optimizer steps)"


def test_a_rollback_restores_weights_optimizers_and_the_lag_and_nothing_else(tiny_model, tmp_path):
    config = run_config(tiny_model, tmp_path / "run")
    algo = config.algorithm_config()
    saved = trained(state_of(config))
    saved.actor_lr_scale = 1.0
    folder = saved.save(tmp_path / "run", config, algo, sharded=False)
    kept = (weights(saved.actor), weights(saved.critic), weights(saved.stale_policy.model),
            load_trainer_state(folder)[0])
    trained(saved, steps=2)  # the run goes on past the checkpoint (and collapses)
    saved.iteration, saved.optimizer_steps = 9, 11
    saved.actor_lr_scale = 0.25  # two rollbacks' factor, lowered before the load
    position, streams = saved.sampler.state(), torch.get_rng_state()
    saved.load(folder, config, algo, Restore.ROLLBACK)
    assert equal(weights(saved.actor), kept[0]) and equal(weights(saved.critic), kept[1])
    assert equal(weights(saved.stale_policy.model), kept[2])
    now = saved.states(config, algo)[0]
    assert equal(now["actor_optimizer"]["state"], kept[3]["actor_optimizer"]["state"])
    assert equal(now["critic_optimizer"]["state"], kept[3]["critic_optimizer"]["state"])
    assert now["actor_scheduler"]["last_epoch"] == kept[3]["actor_scheduler"]["last_epoch"] == 3
    # the run's rate, at the checkpoint's schedule step: actor_lr x 0.25 x warm-up (step 3 of 4)
    assert saved.actor_optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25 * 1.0)
    assert saved.actor_scheduler.base_lrs == [pytest.approx(2.5e-3)]
    assert saved.critic_optimizer.param_groups[0]["lr"] == pytest.approx(2e-2)  # the critic's is not lowered
    assert (saved.iteration, saved.optimizer_steps, saved.actor_lr_scale) == (9, 11, 0.25)
    assert saved.sampler.state() == position and torch.equal(torch.get_rng_state(), streams)
