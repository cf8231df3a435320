"""What a checkpoint holds of a trainer besides the weights, and putting it back.

``--resume`` restores everything (optimizers, schedules, random streams, counters, the prompt sampler's position:
bit-identical to an uninterrupted run); a collapse rollback restores only the weights and optimizer state
(:mod:`stppo_agent.rollback`), so both share :func:`restore_optimizers`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import full_optimizer_state, load_full_optimizer_state, load_trainer_state


def checkpoint_states(trainer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensor state for ``trainer_state.pt``, JSON state for ``trainer_state.json``). Optimizer state is keyed by
    parameter name with full tensors, so a run resumes under either strategy and any number of processes; a
    collective under FSDP2 (every rank calls it)."""
    tensors = {"actor_optimizer": full_optimizer_state(trainer.actor, trainer.actor_optimizer),
               "actor_scheduler": trainer.actor_scheduler.state_dict(), "torch_rng": torch.get_rng_state()}
    if trainer.critic_optimizer is not None:
        tensors["critic_optimizer"] = full_optimizer_state(trainer.critic, trainer.critic_optimizer)
        tensors["critic_scheduler"] = trainer.critic_scheduler.state_dict()
    if torch.cuda.is_available():
        tensors["cuda_rng"] = torch.cuda.get_rng_state_all()
    json_state = {"iteration": trainer.iteration, "optimizer_steps": trainer.optimizer_steps,
                  "nan_skips_total": trainer.nan_skips_total, "sampler": trainer.source.state(),
                  "python_rng": _jsonable(random.getstate()), "numpy_rng": _jsonable(np.random.get_state()),
                  "algo": trainer.config.algo, "model": trainer.config.model}
    return tensors, json_state


def restore_optimizers(trainer, tensors: dict[str, Any]) -> None:
    load_full_optimizer_state(trainer.actor, trainer.actor_optimizer, tensors["actor_optimizer"])
    trainer.actor_scheduler.load_state_dict(tensors["actor_scheduler"])
    if trainer.critic_optimizer is not None:
        load_full_optimizer_state(trainer.critic, trainer.critic_optimizer, tensors["critic_optimizer"])
        trainer.critic_scheduler.load_state_dict(tensors["critic_scheduler"])


def resume(trainer, checkpoint: Path) -> None:
    """Everything but the weights (the models were built from ``checkpoint``)."""
    tensors, state = load_trainer_state(checkpoint)
    restore_optimizers(trainer, tensors)
    torch.set_rng_state(tensors["torch_rng"])
    if "cuda_rng" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda_rng"])
    trainer.iteration, trainer.optimizer_steps = int(state["iteration"]), int(state["optimizer_steps"])
    trainer.nan_skips_total = int(state["nan_skips_total"])
    trainer.source.load(state["sampler"])
    random.setstate(_python_rng(state["python_rng"]))
    np.random.set_state(_numpy_rng(state["numpy_rng"]))
    trainer.report(f"resumed from {checkpoint} (iteration {trainer.iteration}, {trainer.optimizer_steps} "
                   "optimizer steps)")


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _python_rng(state):
    return (state[0], tuple(state[1]), state[2])


def _numpy_rng(state):
    array = state[1]
    return (state[0], np.array(array["ndarray"], dtype=array["dtype"]), *state[2:])
