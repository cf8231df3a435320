"""Logged numbers do not depend on how a batch is split: losses and fractions are ratios of sums over the whole
mini-batch (issue 33.3, 34.5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stppo_agent.algorithms import get_policy_loss, value_loss
from stppo_agent.config import TrainConfig
from stppo_agent.forward import critic_values, token_logprobs
from stppo_agent.trainer import Trainer

from .tiny_models import tiny_llama, word_tokenizer

TIMING = {"rollout_seconds", "iteration_seconds", "rollout_tokens_per_s", "update_tokens_per_s"}


def toy_config(model: Path, out: Path, **overrides) -> TrainConfig:
    values = dict(algo="st_ppo", env="stppo/Toy-v0", model=str(model), output_dir=str(out), iterations=1,
                  prompts_per_iteration=4, samples_per_prompt=2, mini_batch_size=8, micro_batch_size=2,
                  ppo_epochs=1, max_turns=2, max_new_tokens_per_turn=2, max_prompt_tokens=8, max_total_tokens=32,
                  progress=False, tensorboard=False,
                  algorithm={"kl_in_reward": 0.0, "kl_loss_coef": 0.1, "entropy_coef": 0.01})
    values.update(overrides)
    return TrainConfig(**values)


def test_logged_losses_and_fractions_do_not_depend_on_micro_batching(tmp_path):
    """Same batch, micro-batch 1 / 2 / 4 / 8 (the whole mini-batch): the same pg_loss, entropy, kl_loss,
    value_loss, clip and turn-clip fractions, and each equals the loss's own value over the whole batch."""
    model = tiny_llama(tmp_path / "model", word_tokenizer())
    # learning rates 0: every update sees the same weights, so the runs differ only in how the batch is split
    trainer = Trainer(toy_config(model, tmp_path / "run", actor_lr=0.0, critic_lr=0.0), report=lambda _: None)
    batch = trainer.rollout()
    trainer.score(batch)
    noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(0))
    batch.old_logprobs = batch.old_logprobs + 0.3 * noise  # off-policy: ratios leave the clip range
    logged = {}
    for micro in (1, 2, 4, 8):
        trainer.config.micro_batch_size = micro
        logged[micro] = {k: v for k, v in trainer.update(batch).items() if k not in TIMING}
    # the loss applied to the whole batch in one call: the values a logged metric must have
    with torch.no_grad():
        logprobs, entropy = token_logprobs(trainer.actor, batch, with_entropy=True)
        _, _, whole = get_policy_loss("ppo_clip")(
            logprobs=logprobs, old_logprobs=batch.old_logprobs, advantages=batch.advantages,
            loss_mask=batch.loss_mask, turn_ids=batch.turn_ids, config=trainer.algo, ref_logprobs=batch.ref_logprobs,
            entropy=entropy)
        _, critic = value_loss(values=critic_values(trainer.critic, batch), old_values=batch.values,
                               returns=batch.returns, loss_mask=batch.loss_mask, config=trainer.algo)
    whole.update(critic)
    assert 0 < whole["turn_clip_frac"] < 1 and 0 < whole["clip_frac"] < 1  # the fractions mean something
    for key in ("pg_loss", "entropy", "kl_loss", "clip_frac", "turn_clip_frac", "ratio/mean", "ratio/max",
                "ratio/min", "approx_kl", "value_loss", "value_clip_frac", "explained_variance"):
        for micro, metrics in logged.items():
            assert metrics[key] == pytest.approx(float(whole[key]), rel=1e-5, abs=1e-7), (key, micro)
    for micro in (1, 2, 4):  # everything else logged (gradient norms, ||C||, ratio tails) does not move either
        assert set(logged[micro]) == set(logged[8])
        for key, value in logged[8].items():
            assert logged[micro][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (key, micro)
