"""examples/minimal_ppo.py, the one-file reference loop, computes what the Trainer computes: on the same batch its
scoring gives the Trainer's old / reference log-probs, values and advantages, and its update the Trainer's loss,
applied gradient and weights, for ppo and for st_ppo with the clip-bias correction acting. Its main runs."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from stppo_agent.training.config import TrainConfig
from stppo_agent.training.config_sections import (
    CheckpointConfig,
    LoggingConfig,
    MonitorConfig,
    OptimizerConfig,
    RolloutConfig,
)
from stppo_agent.training.trainer import Trainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "minimal_ppo.py"
LR = 1e-3


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("minimal_ppo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def toy_trainer(model: Path, out: Path, algo: str, max_grad_norm: float = 1.0, **algorithm) -> Trainer:
    """One epoch, one mini-batch of the whole batch, one micro-batch: the update the example's loop makes. Three
    tokens per turn, so a turn-level ratio (the geometric mean over a turn) is not the token ratio."""
    config = TrainConfig(algo=algo, env="stppo/Toy-v0", model=str(model), output_dir=str(out), iterations=1,
                         algorithm=algorithm,
                         rollout=RolloutConfig(prompts_per_iteration=4, samples_per_prompt=4, max_turns=2,
                                               max_new_tokens_per_turn=3, max_prompt_tokens=8, max_total_tokens=32),
                         optimizer=OptimizerConfig(mini_batch_size=16, micro_batch_size=16, epochs=1, actor_lr=LR,
                                                   critic_lr=LR, max_grad_norm=max_grad_norm),
                         logging=LoggingConfig(progress=False, tensorboard=False),
                         checkpoint=CheckpointConfig(every=100), monitor=MonitorConfig(on_collapse="none"))
    return Trainer(config, report=lambda _: None)


def as_example_batch(example, batch):
    """The Trainer's RolloutBatch as the example's Batch (the same field names), every tensor copied."""
    return example.Batch(**{f.name: (v.clone() if isinstance(v, torch.Tensor) else v)
                            for f in dataclasses.fields(example.Batch) for v in [getattr(batch, f.name)]})


def test_scoring_gives_the_trainers_log_probs_values_and_advantages(example, tiny_model, tmp_path):
    trainer = toy_trainer(tiny_model, tmp_path, "st_ppo")
    first = trainer.rollout()  # one update first: the actor leaves the reference, the value head leaves 0
    trainer.score(first)
    trainer.update(first)
    batch = trainer.rollout()
    mine = as_example_batch(example, batch)
    trainer.score(batch)
    state = trainer.state
    example.score(mine, state.actor, state.critic, state.reference, trainer.algo)
    # not vacuous: the preset's KL penalty is in both advantages and not 0, nor are the values
    assert trainer.algo.kl_in_reward > 0 and not torch.equal(batch.old_logprobs, batch.ref_logprobs)
    assert bool((batch.values[batch.loss_mask] != 0).all())
    for name in ("old_logprobs", "ref_logprobs", "values", "advantages", "returns"):
        torch.testing.assert_close(getattr(mine, name), getattr(batch, name), msg=name)


CASES = {
    # clipping of the gradient norm binds
    "ppo": ("ppo", 0.1, {}),
    # kappa under the batch's ||C||: the correction's scale > 1, and with ||g|| / scale < max_grad_norm the
    # gradient the optimizer gets is not PPO's (before_grad_clip, the preset's order)
    "st_ppo": ("st_ppo", 1.0, {"clip_bias_kappa": 0.1}),
    "st_ppo_after_grad_clip": ("st_ppo", 0.1, {"clip_bias_kappa": 0.1, "clip_bias_order": "after_grad_clip"}),
}


@pytest.mark.parametrize("case", CASES)
def test_one_update_equals_the_trainers(example, tiny_model, tmp_path, case):
    algo, max_grad_norm, algorithm = CASES[case]
    trainer = toy_trainer(tiny_model, tmp_path, algo, max_grad_norm, **algorithm)
    batch = trainer.rollout()
    trainer.score(batch)
    # off-policy enough that tokens, turns and values are clipped: old log-probs and old values perturbed on the
    # policy tokens (by more than value_clip, 0.5, for the values)
    noise = torch.randn((2, *batch.old_logprobs.shape), generator=torch.Generator().manual_seed(0))
    batch.old_logprobs = torch.where(batch.loss_mask, batch.old_logprobs + noise[0], batch.old_logprobs)
    batch.values = torch.where(batch.loss_mask, batch.values + noise[1], batch.values)
    mine = as_example_batch(example, batch)
    state = trainer.state
    actor, critic = copy.deepcopy(state.actor), copy.deepcopy(state.critic)  # before the Trainer steps
    config = trainer.config
    args = example.Args(algo=algo, epochs=1, mini_batch_size=16, max_grad_norm=max_grad_norm, seed=config.seed)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=config.optimizer.weight_decay)
                  for model in (actor, critic)]

    ours = example.update(mine, actor, critic, *optimizers, trainer.algo, args, state.iteration)
    theirs = trainer.update(batch)

    # not vacuous: a turn holds several policy tokens, tokens and turns are clipped, the clip bites
    assert max(int((batch.turn_ids[row] == turn).sum()) for row in range(batch.batch_size) for turn in (0, 1)) > 1
    assert theirs["clip_frac"] > 0 and theirs["turn_clip_frac"] > 0 and theirs["value_clip_frac"] > 0
    if trainer.algo.clip_bias_correction:
        assert theirs["clip_bias_scale"] > 1.5 and theirs["clip_bias_changed"] == 1.0
    else:
        assert "clip_bias_scale" not in ours and theirs["grad_norm"] > max_grad_norm
    for name in ("pg_loss", "value_loss", "clip_frac", "turn_clip_frac", "value_clip_frac", "grad_norm",
                 "critic_grad_norm",
                 *(("clip_bias_norm", "clip_bias_scale") if trainer.algo.clip_bias_correction else ())):
        assert ours[name] == pytest.approx(theirs[name], rel=1e-5, abs=1e-7), name
    # The applied gradient is the sharp check: AdamW's first step is lr * g / (|g| + eps), blind to g's scale, so
    # the weights alone would not see a clip-bias scale (or a clipping) gone wrong.
    for model, reference in ((actor, state.actor), (critic, state.critic)):
        for (name, param), other in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, other.grad, msg=f"gradient of {name}")
            torch.testing.assert_close(param.detach(), other.detach(), msg=f"weight {name}")


def test_main_trains_two_iterations(example, capsys):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        curve = example.main(["--algo", "st_ppo", "--iterations", "2", "--prompts", "2", "--samples", "4",
                              "--mini-batch-size", "4"])
    finally:
        torch.set_num_threads(threads)
    assert len(curve) == 2 and all(0.0 <= reward <= 1.0 for reward in curve)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["iteration", "1"], ["iteration", "2"]]
    assert all("reward" in line and "clip_bias_scale" in line for line in lines)


def test_rollout_masks_observations_and_numbers_turns(example):
    """Policy tokens carry their turn (0, 1), the env's ``ok`` between turns is masked with turn -1."""
    tokenizer = example.make_tokenizer()
    actor, _, _ = example.make_models(tokenizer, seed=0)
    args = example.Args(prompts=2, samples=2, max_new_tokens=2)
    import gymnasium as gym

    envs = [gym.make("stppo/Toy-v0", turns=args.turns) for _ in range(4)]
    batch = example.rollout(envs, actor, tokenizer, args, torch.Generator().manual_seed(0), iteration=0)
    ok = tokenizer.convert_tokens_to_ids("ok")
    assert torch.equal(batch.loss_mask, batch.turn_ids >= 0)
    assert bool((batch.response_ids[~batch.loss_mask & (batch.attention_mask[:, batch.prompt_width:] == 1)]
                 == ok).all())
    for row in range(4):
        assert batch.turn_ids[row][batch.loss_mask[row]].unique().tolist() == [0, 1]
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
