"""Put a running trainer back to a checkpoint's weights and optimizer state (a collapse rollback).

Unlike ``--resume`` nothing else is rewound: the iteration count, the prompt sampler and the random streams go
on, so the rolled-back run sees new prompts rather than replaying the ones it collapsed on. Nor is the learning
rate: the checkpoint's schedule holds the rate it was saved with, so each rollback multiplies the trainer's own
``actor_lr_scale`` (saved in every later checkpoint) instead: x0.5 twice is x0.25, even when both rollbacks return
to the same checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from stppo_agent.models.loading import load_actor, load_critic
from stppo_agent.runs.checkpoint import load_trainer_state
from stppo_agent.runs.trainer_state import apply_learning_rates, restore_optimizers


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a whole (unsharded) state dict into ``model``, plain or sharded by FSDP2 (each rank keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


@torch.no_grad()
def restore_training_state(trainer, folder: Path, lr_factor: float) -> float:
    """Load ``folder``'s actor (and critic) weights and optimizer/scheduler state into ``trainer``, then multiply
    the trainer's actor learning-rate scale by ``lr_factor``; returns the new scale (the actor's learning rate over
    ``config.actor_lr``, compounded over every rollback so far)."""
    tensors, _ = load_trainer_state(folder)  # verifies the checkpoint first
    config = trainer.config
    load_full_model_state(trainer.actor, load_actor(folder / "actor", config.dtype).state_dict())
    if trainer.critic is not None:
        load_full_model_state(trainer.critic, load_critic(folder / "critic", config.dtype).state_dict())
    restore_optimizers(trainer, tensors)
    trainer.stale_policy.load(tensors.get("stale_policy"), trainer.actor)  # the lagged generator goes back too
    trainer.actor_lr_scale *= lr_factor
    apply_learning_rates(trainer)  # the run's rates over the checkpoint's: only the optimizer moments go back
    if hasattr(trainer.backend, "sync_weights"):  # an engine with its own copy of the weights (vLLM)
        trainer.backend.sync_weights(trainer.actor)
    return trainer.actor_lr_scale
