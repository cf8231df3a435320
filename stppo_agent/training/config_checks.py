"""Checks of a :class:`~stppo_agent.training.config.TrainConfig` that need no model: value ranges, precision
settings, where the PPO ratio's denominator comes from. Each raises ValueError with one line that says what to set."""

from __future__ import annotations

OLD_LOGPROBS = ("recompute", "sampler")


def check_ranges(config) -> None:
    """Values with no meaning that a run would still have taken: max_grad_norm 0 scaled every gradient by 0 (no
    learning, no error), a negative one by a negative factor (ascent); a max_search_error_rate below 0 stopped the
    run for "0% of the searches failed"."""
    for name in ("optimizer.actor_lr", "optimizer.critic_lr", "optimizer.weight_decay", "optimizer.warmup_steps",
                 "monitor.probe_every"):
        if not setting(config, name) >= 0:
            raise ValueError(f"{name} must be >= 0, got {setting(config, name)}")
    if not config.optimizer.max_grad_norm > 0:
        raise ValueError(f"optimizer.max_grad_norm must be > 0, got {config.optimizer.max_grad_norm} (gradients are "
                         "clipped to that norm)")
    if not 0 <= config.monitor.max_search_error_rate <= 1:
        raise ValueError(f"monitor.max_search_error_rate must be in [0, 1], got {config.monitor.max_search_error_rate}")
    if not 0 < config.rollout.vllm_gpu_memory_utilization <= 1:
        raise ValueError("rollout.vllm_gpu_memory_utilization must be in (0, 1], got "
                         f"{config.rollout.vllm_gpu_memory_utilization}")


def check_precision(config) -> None:
    """Weights, FSDP2 compute, autocast and sampler precision: no float16 where gradients are taken (no loss
    scaler), each setting with the strategy it belongs to."""
    precision, strategy = config.precision, config.distributed.strategy
    if precision.fsdp_compute_dtype is not None:
        if strategy != "fsdp2":
            raise ValueError("precision.fsdp_compute_dtype needs distributed.strategy=fsdp2 (DDP computes in "
                             "precision.dtype)")
        if precision.fsdp_compute_dtype not in ("bfloat16", "float16"):
            raise ValueError("precision.fsdp_compute_dtype must be bfloat16 or float16, got "
                             f"{precision.fsdp_compute_dtype!r}")
    from stppo_agent.models.precision import refuse_float16_training, validate_autocast_dtype

    refuse_float16_training("precision.fsdp_compute_dtype", precision.fsdp_compute_dtype)  # no loss scaler
    refuse_float16_training("precision.dtype", precision.dtype)
    if precision.autocast_dtype is not None:
        if strategy == "fsdp2":
            raise ValueError("precision.autocast_dtype is for distributed.strategy=ddp; with fsdp2 use "
                             "precision.fsdp_compute_dtype (FSDP2's own mixed precision)")
        validate_autocast_dtype(precision.autocast_dtype, precision.dtype)
    _check_generation_precision(config)


def _check_generation_precision(config) -> None:
    """generation_autocast_dtype opens a gap between the sampler and a float32 learner; where the learner is not
    float32 there is no gap to open (autocast's float32 head would even hide most of it), so it is refused."""
    precision = config.precision
    name = precision.generation_autocast_dtype
    if name is None:
        return
    if name != "bfloat16":
        raise ValueError(f"precision.generation_autocast_dtype must be bfloat16 (or unset), got {name!r}")
    if config.rollout.backend != "hf":
        raise ValueError("precision.generation_autocast_dtype is for rollout.backend=hf (vLLM samples in its own "
                         "dtype)")
    if precision.dtype != "float32" or precision.autocast_dtype is not None \
            or precision.fsdp_compute_dtype is not None:
        raise ValueError("precision.generation_autocast_dtype=bfloat16 samples in bfloat16 against a float32 learner: "
                         "it needs precision.dtype=float32 and neither precision.autocast_dtype nor "
                         "precision.fsdp_compute_dtype")


def check_staleness(config) -> None:
    """rollout_staleness and stale_objective: the lagged copy needs whole weights (DDP, transformers generate), and
    the decoupled objective a behaviour weight."""
    from stppo_agent.training.stale_policy import OBJECTIVES

    rollout = config.rollout
    if rollout.staleness < 0:
        raise ValueError(f"rollout.staleness must be >= 0, got {rollout.staleness}")
    if rollout.stale_objective not in OBJECTIVES:
        raise ValueError(f"rollout.stale_objective must be {' or '.join(OBJECTIVES)}, got {rollout.stale_objective!r}")
    if rollout.staleness == 0:
        return
    if config.distributed.strategy == "fsdp2" or rollout.backend == "vllm":
        raise ValueError("rollout.staleness > 0 needs distributed.strategy=ddp and rollout.backend=hf (the lagged "
                         "copy of the weights is a whole module; sharded and vLLM copies are not implemented)")
    if rollout.stale_objective == "decoupled" and config.algorithm_config().rollout_correction == "none":
        raise ValueError("rollout.stale_objective=decoupled weights each token by pi_prox / pi_behav: set "
                         "algorithm.rollout_correction to mis, tis or auto (auto picks mis), not none")


def check_old_logprobs(config) -> None:
    """rollout.old_logprobs=sampler takes the ratio's denominator from the sampler, so the combinations that need the
    recomputed one are refused: a rollout correction (its weight pi_old / pi_sample is then 1 on every token) and
    the decoupled objective (its ratio is against the current weights, recomputed before the update)."""
    rollout = config.rollout
    if rollout.old_logprobs not in OLD_LOGPROBS:
        raise ValueError(f"rollout.old_logprobs must be {' or '.join(OLD_LOGPROBS)}, got {rollout.old_logprobs!r}")
    if rollout.old_logprobs != "sampler":
        return
    if rollout.staleness > 0 and rollout.stale_objective == "decoupled":
        raise ValueError("rollout.stale_objective=decoupled takes the ratio against the current weights (recomputed) "
                         "and the lag as a separate weight; rollout.old_logprobs=sampler would take it against the "
                         "lagged sampler: use rollout.old_logprobs=recompute, or rollout.stale_objective=coupled")
    correction = config.algorithm_config().rollout_correction
    if correction != "none":
        raise ValueError(f"rollout.old_logprobs=sampler puts the sampler's log-probs in the ratio, so there is no gap "
                         f"left for rollout_correction={correction} to weigh (its weight is 1 on every token): set "
                         "algorithm.rollout_correction to none or auto, or use rollout.old_logprobs=recompute")


def check_init_from(config) -> None:
    """What init_from cannot combine with (its folder is checked when a run starts from it, before models load:
    a resume never reads it again, so the warm start may be gone by then)."""
    if config.init_from and config.critic_model:
        raise ValueError("init_from loads the critic from the checkpoint; unset critic_model (or start without "
                         "init_from)")


def check_collapse_settings(config) -> None:
    """on_collapse, the monitor's thresholds and the rollback settings."""
    from stppo_agent.monitoring.collapse_rules import ACTIONS, MonitorSettings

    monitor = config.monitor
    if monitor.on_collapse not in ACTIONS:
        raise ValueError(f"monitor.on_collapse must be one of {', '.join(ACTIONS)}, got {monitor.on_collapse!r}")
    MonitorSettings.from_config(config).validate()
    if not 0 < monitor.rollback_lr_factor <= 1:
        raise ValueError(f"monitor.rollback_lr_factor must be in (0, 1], got {monitor.rollback_lr_factor}")
    if monitor.max_rollbacks < 0:
        raise ValueError(f"monitor.max_rollbacks must be >= 0, got {monitor.max_rollbacks}")


def setting(config, name: str):
    """The value of ``section.key`` (or a top-level ``key``) in ``config``."""
    value = config
    for part in name.split("."):
        value = getattr(value, part)
    return value


def validate(config) -> None:
    """Every check of ``config`` that needs no model, in the order that gives the most useful first refusal."""
    from stppo_agent.algorithms.advantages import GROUP_ESTIMATORS
    from stppo_agent.distributed.process_group import STRATEGIES
    from stppo_agent.plugins.loader import load_plugins
    from stppo_agent.rollouts.envs import is_search_env
    from stppo_agent.runs.checkpoint import check_checkpoint_settings
    from stppo_agent.training.resampling import check_dynamic_sampling

    if not config.model:
        raise ValueError("model is required: a Hugging Face folder or hub name (--model)")
    for name in ("iterations", "rollout.prompts_per_iteration", "rollout.samples_per_prompt", "optimizer.epochs",
                 "optimizer.mini_batch_size", "optimizer.micro_batch_size", "rollout.generation_batch_size",
                 "checkpoint.every", "checkpoint.keep", "monitor.probe_prompts"):
        if setting(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {setting(config, name)}")
    check_ranges(config)
    optimizer = config.optimizer
    if optimizer.mini_batch_size % optimizer.micro_batch_size:
        raise ValueError(f"optimizer.mini_batch_size ({optimizer.mini_batch_size}) must be a multiple of "
                         f"optimizer.micro_batch_size ({optimizer.micro_batch_size})")
    if config.distributed.strategy not in STRATEGIES:
        raise ValueError(f"distributed.strategy must be {' or '.join(STRATEGIES)}, got {config.distributed.strategy!r}")
    check_precision(config)
    config.sampling()  # a bad temperature / top_p / top_k fails here, before minutes of model loading
    if config.rollout.backend not in ("hf", "vllm"):
        raise ValueError(f"rollout.backend must be hf or vllm, got {config.rollout.backend!r}")
    check_collapse_settings(config)
    check_old_logprobs(config)  # before the staleness checks: its refusal of the decoupled objective says more
    check_staleness(config)
    check_init_from(config)
    check_checkpoint_settings(config.checkpoint.dtype, config.checkpoint.optimizer, config.monitor.on_collapse)
    load_plugins(config.plugins)  # a plugin may register envs as well as algorithms
    for env_id in (e.strip() for e in config.env.split(",") if e.strip()):
        is_search_env(env_id)  # an unknown id fails here, before minutes of model loading
    algo = config.algorithm_config()
    samples = config.rollout.samples_per_prompt
    check_dynamic_sampling(algo, samples)
    if algo.advantage in GROUP_ESTIMATORS and samples < 2:
        raise ValueError(f"algorithm {config.algo} uses group-relative advantages ({algo.advantage}): a group of one "
                         f"trajectory has advantage 0 and nothing is learned; set rollout.samples_per_prompt >= 2 "
                         f"(e.g. --set rollout.samples_per_prompt=5, Search-R1's GRPO group size)")
    config.rollout_limits().validate()
