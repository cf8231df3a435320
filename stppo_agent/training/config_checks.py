"""Checks of a :class:`~stppo_agent.training.config.TrainConfig` that need no model: value ranges, precision
settings, where the PPO ratio's denominator comes from. Each raises ValueError with one line that says what to set."""

from __future__ import annotations

OLD_LOGPROBS = ("recompute", "sampler")


def check_ranges(config) -> None:
    """Values with no meaning that a run would still have taken: max_grad_norm 0 scaled every gradient by 0 (no
    learning, no error), a negative one by a negative factor (ascent); a max_search_error_rate below 0 stopped the
    run for "0% of the searches failed"."""
    for name in ("actor_lr", "critic_lr", "weight_decay", "warmup_steps", "probe_every"):
        if not getattr(config, name) >= 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(config, name)}")
    if not config.max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {config.max_grad_norm} (gradients are clipped to that norm)")
    if not 0 <= config.max_search_error_rate <= 1:
        raise ValueError(f"max_search_error_rate must be in [0, 1], got {config.max_search_error_rate}")
    if not 0 < config.vllm_gpu_memory_utilization <= 1:
        raise ValueError(f"vllm_gpu_memory_utilization must be in (0, 1], got {config.vllm_gpu_memory_utilization}")


def check_precision(config) -> None:
    """Weights, FSDP2 compute, autocast and sampler precision: no float16 where gradients are taken (no loss
    scaler), each setting with the strategy it belongs to."""
    if config.fsdp_compute_dtype is not None:
        if config.strategy != "fsdp2":
            raise ValueError("fsdp_compute_dtype needs strategy=fsdp2 (DDP computes in `dtype`)")
        if config.fsdp_compute_dtype not in ("bfloat16", "float16"):
            raise ValueError(f"fsdp_compute_dtype must be bfloat16 or float16, got {config.fsdp_compute_dtype!r}")
    from stppo_agent.models.precision import refuse_float16_training, validate_autocast_dtype

    refuse_float16_training("fsdp_compute_dtype", config.fsdp_compute_dtype)  # no loss scaler: see there
    refuse_float16_training("dtype", config.dtype)
    if config.autocast_dtype is not None:
        if config.strategy == "fsdp2":
            raise ValueError("autocast_dtype is for strategy=ddp; with fsdp2 use fsdp_compute_dtype (FSDP2's own "
                             "mixed precision)")
        validate_autocast_dtype(config.autocast_dtype, config.dtype)
    _check_generation_precision(config)


def _check_generation_precision(config) -> None:
    """generation_autocast_dtype opens a gap between the sampler and a float32 learner; where the learner is not
    float32 there is no gap to open (autocast's float32 head would even hide most of it), so it is refused."""
    name = config.generation_autocast_dtype
    if name is None:
        return
    if name != "bfloat16":
        raise ValueError(f"generation_autocast_dtype must be bfloat16 (or unset), got {name!r}")
    if config.generation_backend != "hf":
        raise ValueError("generation_autocast_dtype is for generation_backend=hf (vLLM samples in its own dtype)")
    if config.dtype != "float32" or config.autocast_dtype is not None or config.fsdp_compute_dtype is not None:
        raise ValueError("generation_autocast_dtype=bfloat16 samples in bfloat16 against a float32 learner: it needs "
                         "dtype=float32 and neither autocast_dtype nor fsdp_compute_dtype")


def check_staleness(config) -> None:
    """rollout_staleness and stale_objective: the lagged copy needs whole weights (DDP, transformers generate), and
    the decoupled objective a behaviour weight."""
    from stppo_agent.training.stale_policy import OBJECTIVES

    if config.rollout_staleness < 0:
        raise ValueError(f"rollout_staleness must be >= 0, got {config.rollout_staleness}")
    if config.stale_objective not in OBJECTIVES:
        raise ValueError(f"stale_objective must be {' or '.join(OBJECTIVES)}, got {config.stale_objective!r}")
    if config.rollout_staleness == 0:
        return
    if config.strategy == "fsdp2" or config.generation_backend == "vllm":
        raise ValueError("rollout_staleness > 0 needs strategy=ddp and generation_backend=hf (the lagged copy of "
                         "the weights is a whole module; sharded and vLLM copies are not implemented)")
    if config.stale_objective == "decoupled" and config.algorithm_config().rollout_correction == "none":
        raise ValueError("stale_objective=decoupled weights each token by pi_prox / pi_behav: set "
                         "algorithm.rollout_correction to mis, tis or auto (auto picks mis), not none")


def check_old_logprobs(config) -> None:
    """old_logprobs=sampler takes the ratio's denominator from the sampler, so the combinations that need the
    recomputed one are refused: a rollout correction (its weight pi_old / pi_sample is then 1 on every token) and
    the decoupled objective (its ratio is against the current weights, recomputed before the update)."""
    if config.old_logprobs not in OLD_LOGPROBS:
        raise ValueError(f"old_logprobs must be {' or '.join(OLD_LOGPROBS)}, got {config.old_logprobs!r}")
    if config.old_logprobs != "sampler":
        return
    if config.rollout_staleness > 0 and config.stale_objective == "decoupled":
        raise ValueError("stale_objective=decoupled takes the ratio against the current weights (recomputed) and the "
                         "lag as a separate weight; old_logprobs=sampler would take it against the lagged sampler: "
                         "use old_logprobs=recompute, or stale_objective=coupled")
    correction = config.algorithm_config().rollout_correction
    if correction != "none":
        raise ValueError(f"old_logprobs=sampler puts the sampler's log-probs in the ratio, so there is no gap left "
                         f"for rollout_correction={correction} to weigh (its weight is 1 on every token): set "
                         "algorithm.rollout_correction to none or auto, or use old_logprobs=recompute")


def check_init_from(config) -> None:
    """What init_from cannot combine with (its folder is checked when a run starts from it, before models load:
    a resume never reads it again, so the warm start may be gone by then)."""
    if config.init_from and config.critic_model:
        raise ValueError("init_from loads the critic from the checkpoint; unset critic_model (or start without "
                         "init_from)")


def check_collapse_settings(config) -> None:
    """on_collapse, the monitor's thresholds and the rollback settings."""
    from stppo_agent.monitoring.collapse_rules import ACTIONS, MonitorSettings

    if config.on_collapse not in ACTIONS:
        raise ValueError(f"on_collapse must be one of {', '.join(ACTIONS)}, got {config.on_collapse!r}")
    MonitorSettings.from_config(config).validate()
    if not 0 < config.rollback_lr_factor <= 1:
        raise ValueError(f"rollback_lr_factor must be in (0, 1], got {config.rollback_lr_factor}")
    if config.max_rollbacks < 0:
        raise ValueError(f"max_rollbacks must be >= 0, got {config.max_rollbacks}")
