"""Building what a trainer trains: the :class:`~stppo_agent.training.state.TrainingState` (the policy models from a
model folder or a checkpoint, their distribution -- FSDP2 shards or DDP wrappers --, optimizers with warm-up
schedules, the lagged generator) and the backend that generates rollouts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from stppo_agent.algorithms import AlgorithmConfig
from stppo_agent.distributed import process_group
from stppo_agent.models.loading import load_policy_models
from stppo_agent.models.precision import DTYPES
from stppo_agent.rollouts.generation import TrainingBackend
from stppo_agent.rollouts.hf_generation import HFGenerationBackend
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.stale_policy import StalePolicy
from stppo_agent.training.state import TrainingState
from stppo_agent.training.warm_start import load_warm_optimizers, warm_start_folder


def disable_dropout(model: torch.nn.Module) -> None:
    """RL needs ratio == 1 on-policy: dropout would make the same tokens score differently on each pass."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, 0.0)


def warmup(steps: int) -> Callable[[int], float]:
    return lambda step: min(1.0, (step + 1) / steps) if steps > 0 else 1.0


def build_state(config: TrainConfig, algo: AlgorithmConfig, device: torch.device, sharded: bool,
                checkpoint: Path | None, report: Callable[[str], None] = print) -> TrainingState:
    """The actor, critic and frozen reference (from ``checkpoint`` on resume, from ``init_from`` when a new run
    starts from another's checkpoint), sharded (FSDP2) or wrapped for DDP, their optimizers (the warm start's
    state with ``init_from``) and schedulers, and the lagged generator, at iteration 0 (a resume then loads the
    rest of ``checkpoint``: :meth:`TrainingState.load`)."""
    need_reference = algo.kl_in_reward > 0 or algo.kl_loss_coef > 0
    warm = warm_start_folder(config, algo.use_critic) if checkpoint is None and config.init_from else None
    # The actor and critic come from the checkpoint on resume or warm start; the reference is always `model`.
    start = checkpoint if checkpoint is not None else warm
    actor_path = str(start / "actor") if start is not None else config.model
    critic_path = str(start / "critic") if start is not None else config.critic_model
    models = load_policy_models(actor_path, critic_path=critic_path, use_critic=algo.use_critic,
                                need_reference=need_reference, dtype=config.precision.dtype,
                                gradient_checkpointing=config.optimizer.gradient_checkpointing,
                                reference_path=config.model,
                                autocast_dtype=config.precision.autocast_dtype)
    actor = models.actor.to(device)
    critic = models.critic.to(device) if models.critic is not None else None
    reference = models.reference.to(device) if models.reference is not None else None
    for model in (actor, critic):
        if model is not None:
            disable_dropout(model)
            model.train()
    if sharded:  # sharded in place: the same modules train, score and (gathered) generate
        compute_dtype = DTYPES[config.precision.fsdp_compute_dtype] if config.precision.fsdp_compute_dtype else None
        for model in (actor, critic, reference):
            if model is not None:
                process_group.shard_fsdp2(model, compute_dtype)
        actor_train, critic_train = actor, critic
    else:  # gradients go through DDP wrappers when distributed; generation and scoring use the plain modules
        actor_train = process_group.wrap_ddp(actor, device)
        critic_train = process_group.wrap_ddp(critic, device) if critic is not None else None
    actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=config.optimizer.actor_lr,
                                        weight_decay=config.optimizer.weight_decay)
    critic_optimizer = critic_scheduler = None
    if critic is not None:
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=config.optimizer.critic_lr,
                                             weight_decay=config.optimizer.weight_decay)
        critic_scheduler = torch.optim.lr_scheduler.LambdaLR(critic_optimizer, warmup(config.optimizer.warmup_steps))
    state = TrainingState(
        tokenizer=models.tokenizer, actor=actor, actor_train=actor_train, actor_optimizer=actor_optimizer,
        actor_scheduler=torch.optim.lr_scheduler.LambdaLR(actor_optimizer, warmup(config.optimizer.warmup_steps)),
        critic=critic, critic_train=critic_train, critic_optimizer=critic_optimizer,
        critic_scheduler=critic_scheduler, reference=reference,
        # the weights that generate: the actor's own, or with rollout_staleness an independent lagged copy
        stale_policy=StalePolicy(actor, config.rollout.staleness, config.precision.autocast_dtype))
    if warm is not None:
        load_warm_optimizers(state, config, warm, report)
    return state


def weights_folder(config: TrainConfig, checkpoint: Path | None) -> Path | None:
    """The checkpoint folder whose actor the run continues from: ``checkpoint`` on resume, ``init_from`` for a warm
    start, None for a run from ``model``."""
    if checkpoint is not None:
        return checkpoint
    return Path(config.init_from) if config.init_from else None


def generation_backend(config: TrainConfig, model: torch.nn.Module, tokenizer, rank: int,
                       checkpoint: Path | None) -> TrainingBackend:
    """The rollout backend over ``model`` (the lagged generator's weights); ``checkpoint``: the folder whose actor
    the run continues from (:func:`weights_folder`), where vLLM loads its own copy."""
    if config.rollout.backend == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights can be synced
        from stppo_agent.rollouts.vllm_generation import VLLMGenerationBackend

        path = str(checkpoint / "actor") if checkpoint is not None else config.model
        dtype = "bfloat16" if config.precision.dtype == "float32" else config.precision.dtype
        return VLLMGenerationBackend(path, config.sampling(), dtype=dtype,
                                     seed=process_group.rank_seed(config.seed, rank),
                                     gpu_memory_utilization=config.rollout.vllm_gpu_memory_utilization)
    return HFGenerationBackend(model, tokenizer, config.sampling(), batch_size=config.rollout.generation_batch_size,
                               reuse_cache=config.rollout.reuse_kv_cache,
                               autocast_dtype=config.precision.generation_autocast_dtype)
