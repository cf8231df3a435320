"""Put a running trainer back to a checkpoint's weights and optimizer state (a collapse rollback).

Unlike ``--resume`` nothing else is rewound: the iteration count, the prompt sampler and the random streams go
on, so the rolled-back run sees new prompts rather than replaying the ones it collapsed on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import load_trainer_state
from .models import load_actor, load_critic
from .trainer_state import restore_optimizers


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a whole (unsharded) state dict into ``model``, plain or sharded by FSDP2 (each rank keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def scale_learning_rate(optimizer: torch.optim.Optimizer, scheduler, factor: float) -> None:
    """Multiply the learning rate now and for the rest of the schedule (LambdaLR multiplies its base rates)."""
    for group in optimizer.param_groups:
        group["lr"] *= factor
    scheduler.base_lrs = [base * factor for base in scheduler.base_lrs]
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


@torch.no_grad()
def restore_training_state(trainer, folder: Path, lr_factor: float) -> float:
    """Load ``folder``'s actor (and critic) weights and optimizer/scheduler state into ``trainer``, then scale
    the actor's learning rate by ``lr_factor``; returns the actor's learning rate over ``config.actor_lr``."""
    tensors, _ = load_trainer_state(folder)  # verifies the checkpoint first
    config = trainer.config
    load_full_model_state(trainer.actor, load_actor(folder / "actor", config.dtype).state_dict())
    if trainer.critic is not None:
        load_full_model_state(trainer.critic, load_critic(folder / "critic", config.dtype).state_dict())
    restore_optimizers(trainer, tensors)
    scale_learning_rate(trainer.actor_optimizer, trainer.actor_scheduler, lr_factor)
    if hasattr(trainer.backend, "sync_weights"):  # an engine with its own copy of the weights (vLLM)
        trainer.backend.sync_weights(trainer.actor)
    return trainer.actor_scheduler.base_lrs[0] / config.actor_lr if config.actor_lr else 1.0
