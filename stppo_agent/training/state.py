"""What a run changes as it trains -- the models, their optimizers and schedules, the lagged generator, the
counters, the prompt sampler's position and the random streams -- as one :class:`TrainingState`, with the one
save/load pair that checkpoints, ``--resume`` and a collapse rollback share.

``--resume`` restores everything but the weights (the models were built from the checkpoint): bit-identical to an
uninterrupted run. A rollback restores the weights, the optimizers and the lagged generator only: the iteration
count, the prompt sampler and the random streams go on, so the rolled-back run sees new prompts rather than
replaying the ones it collapsed on. Nor does a rollback take the checkpoint's learning rate: ``actor_lr_scale`` (the
rollbacks' compounded factor, saved in every checkpoint) is the caller's to lower before it loads.

On resume the *current* config's learning rates and weight decay are written into the restored optimizers and
schedules (:meth:`TrainingState.apply_learning_rates`): the actor's rate is ``optimizer.actor_lr`` times that scale,
unless ``optimizer.actor_lr`` itself changed, which then is the rate used (the scale restarts at 1). Which settings may
change on resume and which are refused: :mod:`stppo_agent.runs.resume_settings`; the files:
:mod:`stppo_agent.runs.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from pathlib import Path
from typing import Any, Callable, Collection, Protocol

import numpy as np
import torch

from stppo_agent.algorithms import AlgorithmConfig
from stppo_agent.distributed import process_group
from stppo_agent.models.loading import load_actor, load_critic
from stppo_agent.runs import base_model, rank_streams, resume_settings
from stppo_agent.runs.checkpoint import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    load_trainer_state,
    save_checkpoint,
)
from stppo_agent.runs.trainer_state import previous_settings, run_config
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.stale_policy import StalePolicy

Report = Callable[[str], None]


class Positioned(Protocol):
    """Where a rollout source is in its prompts: saved with the checkpoint, put back on resume."""

    def state(self) -> dict: ...

    def load(self, state: dict) -> None: ...


class Restore(enum.Enum):
    RESUME = "resume"  # everything but the weights, which the models were built from
    ROLLBACK = "rollback"  # the weights, optimizers and lagged generator; counters, sampler and streams go on


@dataclasses.dataclass(eq=False)
class TrainingState:
    """The models a run trains and everything a checkpoint keeps of it.

    ``actor_train`` / ``critic_train`` are what gradients flow through: a DDP wrapper with several processes, else
    the module itself (FSDP2 shards the module in place). ``reference`` is frozen (None without a KL term).
    ``sampler`` is the rollout source, whose position the checkpoint holds (set once the source is built)."""

    tokenizer: Any
    actor: torch.nn.Module
    actor_optimizer: torch.optim.Optimizer
    actor_scheduler: torch.optim.lr_scheduler.LambdaLR
    stale_policy: StalePolicy
    actor_train: torch.nn.Module | None = None
    critic: torch.nn.Module | None = None
    critic_train: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
    reference: torch.nn.Module | None = None
    iteration: int = 0
    """Iterations done (rollouts spent: a rollback does not rewind it)."""
    optimizer_steps: int = 0
    """Actor optimizer steps applied (the policy version)."""
    nan_skips_total: int = 0
    nan_skips_in_a_row: int = 0
    """Not saved: a resumed run starts counting again."""
    actor_lr_scale: float = 1.0
    """The rollbacks' compounded learning-rate factor."""
    sampler: Positioned | None = None

    def __post_init__(self):
        if self.actor_train is None:
            self.actor_train = self.actor
        if self.critic_train is None:
            self.critic_train = self.critic

    # -- save --------------------------------------------------------------------------------------------------
    def states(self, config: TrainConfig, algo: AlgorithmConfig) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensor state for ``trainer_state.pt``, JSON state for ``trainer_state.json``). Optimizer state is keyed
        by parameter name with full tensors, so a run resumes under either strategy and any number of processes; a
        collective under FSDP2 (every rank calls it)."""
        tensors = {"actor_optimizer": full_optimizer_state(self.actor, self.actor_optimizer),
                   "actor_scheduler": self.actor_scheduler.state_dict(), "torch_rng": torch.get_rng_state()}
        if self.critic_optimizer is not None:
            tensors["critic_optimizer"] = full_optimizer_state(self.critic, self.critic_optimizer)
            tensors["critic_scheduler"] = self.critic_scheduler.state_dict()
        if torch.cuda.is_available():
            tensors["cuda_rng"] = torch.cuda.get_rng_state_all()
        if config.rollout.staleness:
            tensors["stale_policy"] = self.stale_policy.state(self.actor)
        json_state = {"iteration": self.iteration, "optimizer_steps": self.optimizer_steps,
                      "nan_skips_total": self.nan_skips_total,
                      "sampler": self.sampler.state() if self.sampler is not None else {},
                      "python_rng": rank_streams.jsonable(random.getstate()),
                      "numpy_rng": rank_streams.jsonable(np.random.get_state()),
                      "algo": config.algo, "model": config.model, "config": run_config(config, algo),
                      "model_sha256": base_model.weights_sha256(config.model) if process_group.is_main() else None,
                      "actor_lr_scale": self.actor_lr_scale}
        rank_streams.save(tensors, json_state)  # every rank's random streams (a collective with several processes)
        return tensors, json_state

    def full_states(self, sharded: bool) -> tuple[dict | None, dict | None]:
        """Full actor and critic state dicts gathered from FSDP2 shards (a collective); None, None unsharded."""
        if not sharded:
            return None, None
        critic = full_model_state(self.critic) if self.critic is not None else None
        return full_model_state(self.actor), critic

    def save(self, run_dir: Path, config: TrainConfig, algo: AlgorithmConfig, *, sharded: bool,
             protect: Collection[int] = ()) -> Path:
        """Write ``checkpoints/step-{iteration}``: rank 0 writes full tensors (gathered from FSDP2 shards), every
        rank takes part in the collectives; ``protect``: checkpoints pruning must keep."""
        tensor_state, json_state = self.states(config, algo)
        actor_state, critic_state = self.full_states(sharded)
        path = run_dir / "checkpoints" / f"step-{self.iteration}"
        if process_group.is_main():  # the full state dicts above live on rank 0 only (cpu_offload)
            path = save_checkpoint(run_dir, self.iteration, actor=self.actor, tokenizer=self.tokenizer,
                                   critic=self.critic, tensor_state=tensor_state, json_state=json_state,
                                   keep=config.checkpoint.keep, actor_state=actor_state, critic_state=critic_state,
                                   protect=protect)
        process_group.barrier()
        return path

    # -- load --------------------------------------------------------------------------------------------------
    def load(self, folder: Path, config: TrainConfig, algo: AlgorithmConfig, restore: Restore,
             report: Report = print) -> None:
        """Put back what ``folder`` holds of this state (see :class:`Restore`), after verifying it."""
        tensors, saved = load_trainer_state(folder)
        if restore is Restore.RESUME:
            self.restore_optimizers(tensors)
            self.stale_policy.load(tensors.get("stale_policy"), self.actor)
            self._resume_progress(tensors, saved, config, report)
            self._resume_learning_rates(folder, saved, config, algo, report)
            return
        with torch.no_grad():
            self._load_weights(folder, config.precision.dtype)
            self.restore_optimizers(tensors)
            self.stale_policy.load(tensors.get("stale_policy"), self.actor)  # the lagged generator goes back too
            self.apply_learning_rates(config)  # the run's rates over the checkpoint's: only the moments go back

    def _load_weights(self, folder: Path, dtype: str) -> None:
        load_full_model_state(self.actor, load_actor(folder / "actor", dtype).state_dict())
        if self.critic is not None:
            load_full_model_state(self.critic, load_critic(folder / "critic", dtype).state_dict())

    def restore_optimizers(self, tensors: dict[str, Any]) -> None:
        load_full_optimizer_state(self.actor, self.actor_optimizer, tensors["actor_optimizer"])
        self.actor_scheduler.load_state_dict(tensors["actor_scheduler"])
        if self.critic_optimizer is not None:
            load_full_optimizer_state(self.critic, self.critic_optimizer, tensors["critic_optimizer"])
            self.critic_scheduler.load_state_dict(tensors["critic_scheduler"])

    def _resume_progress(self, tensors: dict[str, Any], saved: dict[str, Any], config: TrainConfig,
                         report: Report) -> None:
        """Random streams, counters and the sampler's position."""
        torch.set_rng_state(tensors["torch_rng"])
        if "cuda_rng" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(tensors["cuda_rng"])
        self.iteration, self.optimizer_steps = int(saved["iteration"]), int(saved["optimizer_steps"])
        self.nan_skips_total = int(saved["nan_skips_total"])
        if self.sampler is not None:
            self.sampler.load(saved["sampler"])
        random.setstate(rank_streams.python_state(saved["python_rng"]))
        np.random.set_state(rank_streams.numpy_state(saved["numpy_rng"]))
        # ranks > 0: their own streams (the above are rank 0's)
        rank_streams.restore(tensors, saved, seed=config.seed, iteration=self.iteration, report=report)

    def _resume_learning_rates(self, folder: Path, saved: dict[str, Any], config: TrainConfig,
                               algo: AlgorithmConfig, report: Report) -> None:
        previous = previous_settings(config, algo, folder)[0]
        found = resume_settings.check(previous, run_config(config, algo), self.iteration) \
            if previous is not None else []
        scale = saved.get("actor_lr_scale")
        if scale is None:  # written before checkpoints recorded it: what the restored schedule says
            old_lr = ((previous or {}).get("optimizer") or {}).get("actor_lr") or config.optimizer.actor_lr
            scale = self.actor_scheduler.base_lrs[0] / old_lr if old_lr else 1.0
        changed = {key for key, _, _ in found}
        self.actor_lr_scale = 1.0 if "optimizer.actor_lr" in changed else float(scale)
        self.apply_learning_rates(config)
        if not process_group.is_main():
            return
        report(f"resumed from {folder} (iteration {self.iteration}, {self.optimizer_steps} optimizer steps)")
        if found:
            report(f"changed since the checkpoint: {resume_settings.describe(found)}")
        rate = config.optimizer.actor_lr
        if "optimizer.actor_lr" in changed and float(scale) != 1.0:
            report(f"optimizer.actor_lr {rate} is the rate used from now on (the rollbacks' x{scale:g} applied to "
                   "the old one)")
        elif float(scale) != 1.0:
            report(f"actor learning rate {rate * scale:g}: optimizer.actor_lr {rate} x{scale:g} from the run's "
                   "rollbacks")
        if config.logging.save_rollouts and resume_settings.changes_a_replay(found):
            report("this run records its rollouts, and stppo replay applies one config (the one in config.yaml) to "
                   "every iteration: a replay will not reproduce the iterations before this change exactly")

    def apply_learning_rates(self, config: TrainConfig) -> None:
        """Write the config's learning rates (the actor's times ``actor_lr_scale``) and weight decay into the
        optimizers and their schedules, at the schedules' current step. With nothing changed this reproduces the
        restored values bit for bit (the same ``base * lambda(step)`` the schedule computes)."""
        _set_rates(self.actor_optimizer, self.actor_scheduler, config.optimizer.actor_lr * self.actor_lr_scale,
                   config.optimizer.weight_decay)
        if self.critic_optimizer is not None:
            _set_rates(self.critic_optimizer, self.critic_scheduler, config.optimizer.critic_lr,
                       config.optimizer.weight_decay)


def _set_rates(optimizer: torch.optim.Optimizer, scheduler, base_lr: float, weight_decay: float) -> None:
    scheduler.base_lrs = [base_lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = base_lr, base_lr * factor(scheduler.last_epoch)
        group["weight_decay"] = weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
