"""Starting a new run from another run's checkpoint (``init_from: RUN/checkpoints/step-N``): its actor, critic and
AdamW state, so that the first steps continue the warm start's moments instead of a cold AdamW's (whose first
bias-corrected step moves every weight by about lr in the sign of its gradient, whatever the gradient's size).

Everything else is the new run's own: iteration 0, its folder, its learning rates and warm-up schedule (from step
0), its seed, prompt order and counters. A resume reads its own checkpoints, never ``init_from`` again; what a
checkpoint holds and how a resume restores all of it: :mod:`stppo_agent.training.state`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from stppo_agent.distributed import process_group
from stppo_agent.runs.checkpoint import (
    OPTIMIZER_FILE,
    load_full_optimizer_state,
    load_trainer_state,
    why_no_optimizer_state,
)
from stppo_agent.training.state import TrainingState


def warm_start_folder(config, use_critic: bool) -> Path:
    """``config.init_from``, checked before any model loads: a checkpoint folder with an actor, the optimizer
    state and, when the run trains a critic, a critic (ValueError, one line, otherwise)."""
    folder = Path(config.init_from)
    if not (folder / "manifest.json").is_file() or not (folder / "actor").is_dir():
        raise ValueError(f"init_from {folder} is not a checkpoint folder (RUN/checkpoints/step-N, with actor/ and "
                         "manifest.json)")
    if OPTIMIZER_FILE not in json.loads((folder / "manifest.json").read_text()):
        raise ValueError(f"init_from {folder} holds no optimizer state ({why_no_optimizer_state(folder)}): use a "
                         f"checkpoint that holds it, or start from the weights alone with --model {folder / 'actor'} "
                         "(a cold AdamW)")
    if use_critic and not (folder / "critic").is_dir():
        raise ValueError(f"init_from {folder} holds no critic (its run trained none) but algo {config.algo} trains "
                         f"one: start from its weights alone with --model {folder / 'actor'} (a new critic, a cold "
                         "AdamW), or pick a critic-free algorithm")
    return folder


def load_warm_optimizers(state: TrainingState, config, folder: Path, report: Callable[[str], None] = print) -> None:
    """Load the optimizer state of ``folder`` into ``state``'s fresh optimizers (the models were built from
    ``folder``), then set this run's learning rates and schedule from its first step. Raises naming the
    parameter when the state does not fit a model, or when the reference policy differs from the actor."""
    tensors, saved = load_trainer_state(folder)
    _check_same_shapes(state.reference, state.actor, f"model {config.model} (the reference policy)",
                       f"the actor of {folder}")
    _check_fits(tensors["actor_optimizer"], state.actor, f"the actor of {folder}")
    load_full_optimizer_state(state.actor, state.actor_optimizer, tensors["actor_optimizer"])
    if state.critic_optimizer is not None:
        if "critic_optimizer" not in tensors:
            raise ValueError(f"init_from {folder} holds a critic but no critic optimizer state")
        _check_fits(tensors["critic_optimizer"], state.critic, f"the critic of {folder}")
        load_full_optimizer_state(state.critic, state.critic_optimizer, tensors["critic_optimizer"])
    state.apply_learning_rates(config)  # the loaded param groups carry the old run's rates; this run's schedule starts
    if process_group.is_main():
        report(f"started from {folder}: its weights and optimizer state (after {saved['optimizer_steps']} "
               "optimizer steps); iteration 0 of a new run")


def _check_fits(optimizer_state: dict[str, Any], model: torch.nn.Module, what: str) -> None:
    """Every trainable parameter of ``model`` has its moments in ``optimizer_state`` (a full state keyed by
    parameter name), of its shape, and no other parameter does."""
    params = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    saved = {name: tuple(moments["exp_avg"].shape) for name, moments in optimizer_state["state"].items()
             if "exp_avg" in moments}
    listed = {name for group in optimizer_state["param_groups"] for name in group["params"]}
    for name in sorted(set(params) | listed):
        if name not in params or name not in listed:
            raise ValueError(f"the optimizer state of {what} does not fit the model built here: parameter {name} is "
                             f"{'only in the optimizer state' if name not in params else 'missing from it'}")
        if name in saved and saved[name] != params[name]:
            raise ValueError(f"the optimizer state of {what} does not fit the model built here: {name} has shape "
                             f"{list(saved[name])} there, {list(params[name])} here")


def _check_same_shapes(model: torch.nn.Module | None, other: torch.nn.Module, what: str, other_what: str) -> None:
    if model is None:
        return
    mine = {name: tuple(p.shape) for name, p in model.named_parameters()}
    theirs = {name: tuple(p.shape) for name, p in other.named_parameters()}
    if mine != theirs:
        name = next(n for n in sorted(set(mine) | set(theirs)) if mine.get(n) != theirs.get(n))
        raise ValueError(f"{what} is not the architecture of {other_what} ({name}: {list(mine.get(name, []))} vs "
                         f"{list(theirs.get(name, []))}): leave model unset to take the checkpoint's actor")
