"""What a checkpoint holds of a trainer besides the weights, and putting it back.

``--resume`` restores everything (optimizers, schedules, random streams, counters, the prompt sampler's position:
bit-identical to an uninterrupted run); a collapse rollback restores only the weights and optimizer state
(:mod:`stppo_agent.monitoring.rollback`), so both share :func:`restore_optimizers`.

A checkpoint also records the config it was trained with, the sha256 of its base model's weights (a moved copy of
that model is accepted on resume: :mod:`stppo_agent.runs.base_model`) and ``actor_lr_scale``, the product of the
rollbacks' learning-rate factors so far. On resume the *current* config's learning rates and weight decay are
written into the restored optimizers and schedules (:func:`apply_learning_rates`): the actor's rate is
``actor_lr`` times that scale, unless ``actor_lr`` itself changed, which then is the rate used (the scale restarts
at 1). Which settings may change on resume and which are refused: :mod:`stppo_agent.runs.resume_settings`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from stppo_agent.distributed import process_group
from stppo_agent.runs import base_model, rank_streams, resume_settings
from stppo_agent.runs.checkpoint import full_optimizer_state, load_full_optimizer_state, load_trainer_state


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
    if trainer.config.rollout_staleness:
        tensors["stale_policy"] = trainer.stale_policy.state(trainer.actor)
    json_state = {"iteration": trainer.iteration, "optimizer_steps": trainer.optimizer_steps,
                  "nan_skips_total": trainer.nan_skips_total, "sampler": trainer.source.state(),
                  "python_rng": rank_streams.jsonable(random.getstate()),
                  "numpy_rng": rank_streams.jsonable(np.random.get_state()),
                  "algo": trainer.config.algo, "model": trainer.config.model, "config": run_config(trainer),
                  "model_sha256": base_model.weights_sha256(trainer.config.model) if process_group.is_main() else None,
                  "actor_lr_scale": trainer.actor_lr_scale}
    rank_streams.save(tensors, json_state)  # every rank's random streams (a collective with several processes)
    return tensors, json_state


def run_config(trainer) -> dict[str, Any]:
    """The trainer's config as ``config.yaml`` records it (every algorithm field resolved), as plain values."""
    return yaml.safe_load(trainer.config.to_yaml(resolved=trainer.algo))


def checkpoint_config(checkpoint: Path) -> dict[str, Any] | None:
    """The config ``checkpoint`` was trained with: its own record, or for checkpoints written before they held one,
    the run's ``config.yaml`` (read before the resumed run rewrites it)."""
    from stppo_agent.runs.config_yaml import NumberLoader

    state = json.loads((checkpoint / "trainer_state.json").read_text())
    if "config" in state:
        return state["config"]
    path = checkpoint.parent.parent / "config.yaml"
    return yaml.load(path.read_text(), Loader=NumberLoader) if path.exists() else None


def check_resume_settings(trainer, checkpoint: Path | None) -> None:
    """Refuse (ValueError, one line) a resume that changes a setting the checkpoint is tied to; call it before the
    models load, so that a refusal costs seconds."""
    if checkpoint is not None:
        previous, iteration = _previous_settings(trainer, checkpoint,
                                                 trainer.report if process_group.is_main() else None)
        if previous is not None:
            resume_settings.check(previous, run_config(trainer), iteration)


def _previous_settings(trainer, checkpoint: Path, report=None) -> tuple[dict[str, Any] | None, int]:
    """The checkpoint's config as the resume compares it (its base model's new place, when the resume names a
    copy of the same weights) and its iteration."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    previous = checkpoint_config(checkpoint)
    if previous is not None:
        needed = trainer.algo.kl_in_reward > 0 or trainer.algo.kl_loss_coef > 0  # the reference is the base model
        previous = dict(base_model.reconcile(previous, run_config(trainer), state.get("model_sha256"), needed,
                                             report))
    return previous, int(state["iteration"])


def apply_learning_rates(trainer) -> None:
    """Write the config's learning rates (the actor's times ``trainer.actor_lr_scale``) and weight decay into the
    optimizers and their schedules, at the schedules' current step. With nothing changed this reproduces the
    restored values bit for bit (the same ``base * lambda(step)`` the schedule computes)."""
    config = trainer.config
    _set_rates(trainer.actor_optimizer, trainer.actor_scheduler, config.actor_lr * trainer.actor_lr_scale,
               config.weight_decay)
    if trainer.critic_optimizer is not None:
        _set_rates(trainer.critic_optimizer, trainer.critic_scheduler, config.critic_lr, config.weight_decay)


def _set_rates(optimizer: torch.optim.Optimizer, scheduler, base_lr: float, weight_decay: float) -> None:
    scheduler.base_lrs = [base_lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = base_lr, base_lr * factor(scheduler.last_epoch)
        group["weight_decay"] = weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


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
    trainer.stale_policy.load(tensors.get("stale_policy"), trainer.actor)
    torch.set_rng_state(tensors["torch_rng"])
    if "cuda_rng" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda_rng"])
    trainer.iteration, trainer.optimizer_steps = int(state["iteration"]), int(state["optimizer_steps"])
    trainer.nan_skips_total = int(state["nan_skips_total"])
    trainer.source.load(state["sampler"])
    random.setstate(rank_streams.python_state(state["python_rng"]))
    np.random.set_state(rank_streams.numpy_state(state["numpy_rng"]))
    rank_streams.restore(trainer, tensors, state)  # ranks > 0: their own streams (the above are rank 0's)
    previous = _previous_settings(trainer, checkpoint)[0]
    found = resume_settings.check(previous, run_config(trainer), trainer.iteration) if previous is not None else []
    scale = state.get("actor_lr_scale")
    if scale is None:  # written before checkpoints recorded it: what the restored schedule says
        old_lr = (previous or {}).get("actor_lr") or trainer.config.actor_lr
        scale = trainer.actor_scheduler.base_lrs[0] / old_lr if old_lr else 1.0
    changed = {key for key, _, _ in found}
    trainer.actor_lr_scale = 1.0 if "actor_lr" in changed else float(scale)
    apply_learning_rates(trainer)
    if not process_group.is_main():
        return
    trainer.report(f"resumed from {checkpoint} (iteration {trainer.iteration}, {trainer.optimizer_steps} "
                   "optimizer steps)")
    if found:
        trainer.report(f"changed since the checkpoint: {resume_settings.describe(found)}")
    if "actor_lr" in changed and float(scale) != 1.0:
        trainer.report(f"actor_lr {trainer.config.actor_lr} is the rate used from now on (the rollbacks' x{scale:g} "
                       "applied to the old one)")
    elif float(scale) != 1.0:
        trainer.report(f"actor learning rate {trainer.config.actor_lr * scale:g}: actor_lr {trainer.config.actor_lr} "
                       f"x{scale:g} from the run's rollbacks")
    if found and trainer.config.save_rollouts:
        trainer.report("this run records its rollouts, and stppo replay applies one config (the one in config.yaml) "
                       "to every iteration: a replay will not reproduce the iterations before this change exactly")
