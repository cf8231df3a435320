"""With several processes the trainer whitens advantages over the global batch -- but only those of an estimator
that whitens at all: GRPO's and RLOO's are normalised within their groups and never whitened, so a run under
torchrun must leave them as one process leaves them."""

from __future__ import annotations

from pathlib import Path

import pytest

from stppo_agent.distributed import process_group
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.training.scoring import score_batch
from stppo_agent.training.trainer import Trainer

from .test_trainer import toy_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer())


@pytest.mark.parametrize("algo, whitened", [("ppo", True), ("grpo", False), ("so_grpo", False)])
def test_only_an_estimator_that_whitens_is_whitened_over_the_global_batch(tiny_model, tmp_path, monkeypatch, algo,
                                                                          whitened):
    config = toy_config(tiny_model, tmp_path, algo, iterations=1,
                        rollout=dict(prompts_per_iteration=4, samples_per_prompt=4),
                        optimizer=dict(mini_batch_size=8, micro_batch_size=8))
    trainer = Trainer(config, report=lambda _: None)
    assert trainer.algo.whiten_advantages  # the presets leave it on: the estimator decides
    batch = trainer.rollout()
    calls = []
    monkeypatch.setattr(process_group, "distributed_whiten", lambda values, mask: calls.append(1) or values)
    state = trainer.state
    score_batch(batch, config=config, algo=trainer.algo, actor=state.actor, generator=state.actor,
                reference=state.reference, critic=state.critic, device=trainer.device, world=2)
    assert bool(calls) == whitened
