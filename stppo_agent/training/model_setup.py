"""Building what a trainer trains: the policy models from a model folder or a checkpoint, their distribution
(FSDP2 shards or DDP wrappers), optimizers with warm-up schedules, and the backend that generates rollouts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from stppo_agent.distributed import process_group
from stppo_agent.models.loading import load_policy_models
from stppo_agent.models.precision import DTYPES
from stppo_agent.rollouts.hf_generation import HFGenerationBackend
from stppo_agent.training.stale_policy import StalePolicy
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


def build_models(trainer, checkpoint: Path | None) -> None:
    """The actor, critic and frozen reference (from ``checkpoint`` on resume, from ``init_from`` when a new run
    starts from another's checkpoint), sharded (FSDP2) or wrapped for DDP, their optimizers (the warm start's
    state with ``init_from``) and schedulers, and the generation backend, set on ``trainer``."""
    config, algo = trainer.config, trainer.algo
    need_reference = algo.kl_in_reward > 0 or algo.kl_loss_coef > 0
    warm = warm_start_folder(config, algo.use_critic) if checkpoint is None and config.init_from else None
    # The actor and critic come from the checkpoint on resume or warm start; the reference is always `model`.
    start = checkpoint if checkpoint is not None else warm
    actor_path = str(start / "actor") if start is not None else config.model
    critic_path = str(start / "critic") if start is not None else config.critic_model
    models = load_policy_models(actor_path, critic_path=critic_path, use_critic=algo.use_critic,
                                need_reference=need_reference, dtype=config.dtype,
                                gradient_checkpointing=config.gradient_checkpointing, reference_path=config.model,
                                autocast_dtype=config.autocast_dtype)
    trainer.tokenizer = models.tokenizer
    trainer.actor = models.actor.to(trainer.device)
    trainer.critic = models.critic.to(trainer.device) if models.critic is not None else None
    trainer.reference = models.reference.to(trainer.device) if models.reference is not None else None
    for model in (trainer.actor, trainer.critic):
        if model is not None:
            disable_dropout(model)
            model.train()
    if trainer.sharded:  # sharded in place: the same modules train, score and (gathered) generate
        compute_dtype = DTYPES[config.fsdp_compute_dtype] if config.fsdp_compute_dtype else None
        for model in (trainer.actor, trainer.critic, trainer.reference):
            if model is not None:
                process_group.shard_fsdp2(model, compute_dtype)
        trainer.actor_train, trainer.critic_train = trainer.actor, trainer.critic
    else:  # gradients go through DDP wrappers when distributed; generation and scoring use the plain modules
        trainer.actor_train = process_group.wrap_ddp(trainer.actor, trainer.device)
        trainer.critic_train = process_group.wrap_ddp(trainer.critic, trainer.device) \
            if trainer.critic is not None else None
    trainer.actor_optimizer = torch.optim.AdamW(trainer.actor.parameters(), lr=config.actor_lr,
                                                weight_decay=config.weight_decay)
    trainer.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.actor_optimizer, warmup(config.warmup_steps))
    trainer.critic_optimizer = trainer.critic_scheduler = None
    if trainer.critic is not None:
        trainer.critic_optimizer = torch.optim.AdamW(trainer.critic.parameters(), lr=config.critic_lr,
                                                     weight_decay=config.weight_decay)
        trainer.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.critic_optimizer,
                                                                     warmup(config.warmup_steps))
    if warm is not None:
        load_warm_optimizers(trainer, warm)
    # the weights that generate: the actor's own, or with rollout_staleness an independent lagged copy
    trainer.stale_policy = StalePolicy(trainer.actor, config.rollout_staleness, config.autocast_dtype)
    trainer.backend = generation_backend(trainer, start)


def generation_backend(trainer, checkpoint: Path | None):
    """The rollout backend; ``checkpoint``: the folder whose actor the run continues from (resume or warm start)."""
    if trainer.config.generation_backend == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights can be synced
        from stppo_agent.rollouts.vllm_generation import VLLMGenerationBackend

        path = str(checkpoint / "actor") if checkpoint is not None else trainer.config.model
        dtype = "bfloat16" if trainer.config.dtype == "float32" else trainer.config.dtype
        return VLLMGenerationBackend(path, trainer.config.sampling(), dtype=dtype,
                                     seed=process_group.rank_seed(trainer.config.seed, trainer.rank),
                                     gpu_memory_utilization=trainer.config.vllm_gpu_memory_utilization)
    return HFGenerationBackend(trainer.stale_policy.model, trainer.tokenizer, trainer.config.sampling(),
                               batch_size=trainer.config.generation_batch_size,
                               reuse_cache=trainer.config.reuse_kv_cache,
                               autocast_dtype=trainer.config.generation_autocast_dtype)
