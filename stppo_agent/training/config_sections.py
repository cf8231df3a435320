"""The sections of :class:`~stppo_agent.training.config.TrainConfig`: one dataclass per concern, spelled
``section.key`` on the command line (``--set rollout.samples_per_prompt=8``) and nested in YAML.

:data:`~stppo_agent.runs.config_yaml.RENAMED` maps each flat name of the earlier, one-level config to its place here: it
migrates a run folder's old ``config.yaml`` and tells a command line that still uses an old name where the setting went.
"""

from __future__ import annotations

import dataclasses

from stppo_agent.monitoring.collapse_rules import MonitorSettings
from stppo_agent.rollouts.turn_loop import RolloutLimits
from stppo_agent.runs.config_yaml import RENAMED

__all__ = ["RENAMED", "SECTIONS", "CheckpointConfig", "DistributedConfig", "LoggingConfig", "MonitorConfig",
           "OptimizerConfig", "PrecisionConfig", "RolloutConfig"]


@dataclasses.dataclass
class RolloutConfig:
    """How rollouts are sampled: batch shape, length limits, sampling, the generation backend, the off-policy
    stressors and where the PPO ratio's denominator comes from."""

    prompts_per_iteration: int = 8
    """Distinct prompts per iteration."""
    samples_per_prompt: int = 1
    """Trajectories per prompt (the GRPO group size; use >= 2 for group-based advantages)."""
    generation_batch_size: int = 64
    """Trajectories per transformers generate call (HF backend). Generation is latency-bound on a GPU, so this is
    kept apart from optimizer.micro_batch_size: measured on an H200, chunks of 8 instead of 32 made rollouts 2.6x
    slower. Lower it if the KV cache of this many contexts does not fit."""
    # Rollout limits: defaults and meanings from RolloutLimits (the one place they live).
    max_turns: int = RolloutLimits.max_turns
    """Env steps per trajectory (the env truncates after this many)."""
    max_new_tokens_per_turn: int = RolloutLimits.max_new_tokens_per_turn
    """Tokens the policy may generate in one turn."""
    max_observation_tokens: int = RolloutLimits.max_observation_tokens
    """Tokens of one observation kept (the rest is cut, as Search-R1 does)."""
    max_prompt_tokens: int = RolloutLimits.max_prompt_tokens
    """Tokens of the prompt; a longer prompt is an error naming this limit."""
    max_total_tokens: int = RolloutLimits.max_total_tokens
    """Prompt + response; a trajectory that reaches it ends (finish_reason max_total_tokens)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (0: greedy). The trainer scores old, reference and updated log-probs
    at the same temperature and top_k / top_p (stppo_agent/rollouts/sampling.py), so ratios compare like with like."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the most likely tokens whose probability exceeds top_p (1: off)."""
    top_k: int = 0
    """Sample from the k most likely tokens (0: off); applied before top_p, as transformers and vLLM do."""
    backend: str = "hf"
    """hf (transformers generate) or vllm (colocated vLLM engine, weights synced after every update; GPU only)."""
    reuse_kv_cache: bool = True
    """HF backend: continue each trajectory's key/value cache from its previous turn instead of re-encoding the
    transcript every turn (same tokens; stppo_agent/rollouts/turn_cache.py)."""
    vllm_gpu_memory_utilization: float = 0.35
    """Share of GPU memory the vLLM engine may take (the rest is the trainer's)."""
    staleness: int = 0
    """Off-policy stressor: iteration i's rollouts are sampled by the policy as it was K iterations earlier (after
    max(0, i - K) updates), the data an asynchronous trainer's learner receives; the lag is logged as `staleness`
    and kept in checkpoints (stppo_agent/training/stale_policy.py). 0: generation by the current policy."""
    stale_objective: str = "coupled"
    """With staleness > 0: coupled (the PPO ratio is taken against the lagged behaviour policy) or decoupled
    (AReaL's decoupled PPO: the ratio against the current weights before the update, the lag as a capped,
    stop-gradient importance weight: algorithm.rollout_correction, mis unless set, capped at
    algorithm.rollout_correction_cap)."""
    old_logprobs: str = "recompute"
    """The PPO ratio's denominator: recompute (a forward of the behaviour weights before the update, in the
    learner's precision) or sampler (the log-probs the sampler computed while generating, as vLLM-based trainers
    and verl's rollout-log-prob mode take them: no extra forward, and a sampler/learner precision gap then reaches
    the ratio and the clip). With sampler, algorithm.rollout_correction auto is none (the ratio holds the gap) and
    tis / mis are refused; stale_objective=decoupled needs recomputed log-probs."""


@dataclasses.dataclass
class OptimizerConfig:
    """The update: epochs and batch geometry, learning rates, gradient clipping."""

    epochs: int = 1
    """PPO epochs: passes over each rollout batch."""
    mini_batch_size: int = 8
    """Trajectories per optimizer step."""
    micro_batch_size: int = 4
    """Trajectories per forward/backward (gradient accumulation inside a mini-batch)."""
    actor_lr: float = 1e-6
    """Actor learning rate (Search-R1 PPO: 1e-6)."""
    critic_lr: float = 1e-5
    """Critic learning rate (Search-R1 PPO: 1e-5)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient-norm clipping, after the clip-bias correction."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, more compute)."""


@dataclasses.dataclass
class PrecisionConfig:
    """The dtypes of weights and forward passes, for training and for sampling."""

    dtype: str = "float32"
    """float32 or bfloat16 for the models' weights (float16 is refused for training: no loss scaler)."""
    autocast_dtype: str | None = None
    """bfloat16: run the forward passes (generation, scoring, training) under torch.autocast with float32
    weights, gradients and optimizer state, output heads in float32 (stppo_agent/models/precision.py); faster on
    GPUs and on CPUs with AMX. auto: bfloat16 on a GPU that supports it or a CPU with AMX, else float32
    (config.yaml records the choice). float16 is refused: it needs a loss scaler, which stppo lacks. For
    distributed.strategy=fsdp2 use fsdp_compute_dtype instead."""
    fsdp_compute_dtype: str | None = None
    """distributed.strategy=fsdp2 only: bfloat16 to gather weights and compute forward/backward in that dtype while
    the sharded master weights and AdamW state stay in `dtype` (float32) and gradients are reduced in float32
    (FSDP2's MixedPrecisionPolicy). None: compute in `dtype`. float16 is refused (no loss scaler)."""
    generation_autocast_dtype: str | None = None
    """Off-policy stressor: bfloat16 runs the sampler's forward passes, output head included, under bfloat16
    autocast while scoring and training stay in float32 -- the precision gap between a bfloat16 inference engine
    (vLLM serving a float32-trained policy) and its learner, on the HF backend. The gap is logged as
    rollout_logprob_diff; algorithm.rollout_correction=auto corrects it with TIS, as with vLLM (none leaves it
    uncorrected). Needs dtype=float32 and autocast_dtype unset. None: the sampler computes as the learner."""


@dataclasses.dataclass
class CheckpointConfig:
    """When checkpoints are written, how many are kept and what they hold."""

    every: int = 10
    """Checkpoint every N iterations (and always at the end)."""
    keep: int = 2
    """How many of the newest checkpoints to keep."""
    dtype: str | None = None
    """bfloat16 (or float16): write checkpoint weights (actor, critic) in that dtype, half of float32's disk; resume
    loads them back into precision.dtype and continues from the rounded weights. None: the weights' own dtype."""
    optimizer: str = "all"
    """all: every kept checkpoint holds the optimizer state (any of them resumes exactly); newest: only the newest
    does (resume needs no other), older ones drop it, two thirds of their size with AdamW (not with rollback);
    none: no checkpoint holds it (weights to evaluate or start a new run from; --resume refuses them)."""


@dataclasses.dataclass
class MonitorConfig:
    """The collapse monitor, what an alarm does, the stop conditions and the probe of the current policy."""

    on_collapse: str = "warn"
    """What a collapse alarm does: none (no monitoring), warn (a line and a metrics.jsonl event), stop (checkpoint and
    stop with advice) or rollback (restore the newest healthy checkpoint, scale optimizer.actor_lr by
    rollback_lr_factor and go on). Signals and rules: stppo_agent/monitoring/collapse_rules.py."""
    # the monitor's rule parameters default to the monitor's own values (one place)
    window: int = MonitorSettings.window
    """Iterations of history each signal is compared with (median and MAD)."""
    warmup: int = MonitorSettings.warmup
    """Iterations of history a signal needs before it can trip."""
    z: float = MonitorSettings.z
    """Robust z-score beyond which a signal trips."""
    patience: int = MonitorSettings.patience
    """Consecutive iterations one family of signals must trip to raise an alarm on its own."""
    min_families: int = MonitorSettings.min_families
    """Families of signals tripping in the same iteration that raise an alarm at once."""
    drawdown: float = MonitorSettings.drawdown
    """Share of its running best that the reward's moving average must lose to trip."""
    thresholds: dict = dataclasses.field(default_factory=lambda: {"kl_to_reference": 1.0})
    """Absolute limits of signals, active from the first iteration (--set monitor.thresholds.KEY=LIMIT)."""
    rollback_lr_factor: float = 0.5
    """monitor.on_collapse=rollback: the actor learning rate is multiplied by this at each rollback."""
    max_rollbacks: int = 2
    """monitor.on_collapse=rollback: rollbacks before an alarm stops the run instead."""
    max_nan_skips: int = 3
    """Consecutive skipped updates (NaN/inf loss or gradient) before the run stops."""
    max_search_error_rate: float = 0.05
    """Stop when more than this share of an iteration's searches failed (a retriever that is down would otherwise
    train the policy on error observations)."""
    probe_every: int = 0
    """Every N iterations the current actor (not a lagged generator) plays probe_prompts fixed prompts; probe/reward,
    probe/invalid_action_rate, probe/policy_version go to metrics.jsonl (stppo_agent/training/probe.py). 0: off."""
    probe_prompts: int = 8
    """Prompts each probe plays: the same ones every time (with samples of their own)."""


@dataclasses.dataclass
class DistributedConfig:
    """Several processes under torchrun."""

    strategy: str = "ddp"
    """Data-parallel strategy under torchrun: ddp (whole model per rank) or fsdp2 (parameters, gradients and
    optimizer state sharded over the ranks by torch.distributed.fsdp.fully_shard; also runs in one process)."""
    share_retriever: bool = True
    """With several processes and a local retriever spec, one process per node serves the index to that node's ranks
    over HTTP (stppo_agent/distributed/shared_retrieval.py)."""


@dataclasses.dataclass
class LoggingConfig:
    """What the run writes besides metrics.jsonl and checkpoints, and what it shows."""

    tensorboard: bool = True
    """Write tensorboard/ event files."""
    wandb_project: str | None = None
    """Log to Weights & Biases too when set (needs `pip install wandb`)."""
    progress: bool = True
    """Show a progress bar."""
    save_rollouts: bool = False
    """Record every iteration's batch and the initial weights under rollouts/ for `stppo replay`
    (safetensors + JSON lines; see stppo_agent/runs/recording.py for the format)."""
    step_diagnostics: bool = False
    """Write steps.jsonl: per optimizer step, the gradient's cosine to the iteration's first (on-policy) one,
    token/turn ratio tails, clip shares, ||C|| (measured for every algorithm: one extra backward on off-policy
    steps) and norms. On by default in `stppo replay`."""


SECTIONS: dict[str, type] = {
    "rollout": RolloutConfig, "optimizer": OptimizerConfig, "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig, "monitor": MonitorConfig, "distributed": DistributedConfig,
    "logging": LoggingConfig,
}
