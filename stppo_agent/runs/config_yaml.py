"""Reading the YAML of config files and of a run's config.yaml, and the layout of the config.yaml of earlier
versions: their flat names (:data:`RENAMED`) and the migration to sections (:func:`migrate_flat`)."""

from __future__ import annotations

import re
from typing import Any

import yaml


class NumberLoader(yaml.SafeLoader):
    """YAML 1.1 (PyYAML) reads ``1e-6`` as a string (its floats need a dot); this loader reads every common
    spelling of a number as one: 1e-6, 1E+3, .5, 5., -2.5e-3, as YAML 1.2 and JSON do."""


NumberLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))

# the flat names of the one-level config (stppo 0.1) whose place or spelling changed -> section.key
RENAMED: dict[str, str] = {
    **{name: f"rollout.{name}" for name in (
        "prompts_per_iteration", "samples_per_prompt", "generation_batch_size", "max_turns", "max_new_tokens_per_turn",
        "max_observation_tokens", "max_prompt_tokens", "max_total_tokens", "temperature", "top_p", "top_k",
        "reuse_kv_cache", "vllm_gpu_memory_utilization", "stale_objective", "old_logprobs")},
    "generation_backend": "rollout.backend", "rollout_staleness": "rollout.staleness",
    "ppo_epochs": "optimizer.epochs",
    **{name: f"optimizer.{name}" for name in (
        "mini_batch_size", "micro_batch_size", "actor_lr", "critic_lr", "warmup_steps", "weight_decay",
        "max_grad_norm", "gradient_checkpointing")},
    **{name: f"precision.{name}" for name in (
        "dtype", "autocast_dtype", "fsdp_compute_dtype", "generation_autocast_dtype")},
    "save_every": "checkpoint.every", "keep_checkpoints": "checkpoint.keep", "checkpoint_dtype": "checkpoint.dtype",
    "checkpoint_optimizer": "checkpoint.optimizer",
    "on_collapse": "monitor.on_collapse",
    **{f"collapse_{name}": f"monitor.{name}" for name in (
        "window", "warmup", "z", "patience", "min_families", "drawdown", "thresholds")},
    **{name: f"monitor.{name}" for name in (
        "rollback_lr_factor", "max_rollbacks", "max_nan_skips", "max_search_error_rate", "probe_every",
        "probe_prompts")},
    **{name: f"distributed.{name}" for name in ("strategy", "share_retriever")},
    **{name: f"logging.{name}" for name in (
        "tensorboard", "wandb_project", "progress", "save_rollouts", "step_diagnostics")},
}


def migrate_flat(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``values`` with every flat name of earlier versions moved to its section (``actor_lr: 1e-6`` ->
    ``optimizer: {actor_lr: 1e-6}``), and the names moved."""
    moved = [key for key in values if key in RENAMED]
    out = {k: v for k, v in values.items() if k not in RENAMED}
    for old in moved:
        section, _, key = RENAMED[old].partition(".")
        if not isinstance(out.get(section, {}), dict):
            raise ValueError(f"config field {section} must be a mapping, got {out[section]!r}")
        out[section] = {**out.get(section, {}), key: values[old]}
    return out, moved
