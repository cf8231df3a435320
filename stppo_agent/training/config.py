"""The training config: one dataclass, filled from a YAML file, then ``--set key=value`` overrides.

Algorithm fields (``clip_high``, ``kl_loss_coef``, ...) default to the chosen preset (``--algo``); the user's
values win: ``--set algorithm.clip_high=0.28`` (or the ``algorithm:`` mapping of the YAML file).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from stppo_agent.algorithms import ALGORITHMS, AlgorithmConfig, recorded_algorithm, resolve_rollout_correction
from stppo_agent.algorithms.advantages import GROUP_ESTIMATORS
from stppo_agent.distributed.process_group import STRATEGIES
from stppo_agent.plugins.loader import load_plugins
from stppo_agent.rollouts.sampling import SamplingSettings
from stppo_agent.rollouts.turn_loop import RolloutLimits
from stppo_agent.runs.config_yaml import NumberLoader
from stppo_agent.training.config_checks import (
    check_collapse_settings,
    check_init_from,
    check_old_logprobs,
    check_precision,
    check_ranges,
    check_staleness,
)
from stppo_agent.training.resampling import check_dynamic_sampling
from stppo_agent.training.stale_policy import is_decoupled
from stppo_envs.suggest import closest


@dataclasses.dataclass
class TrainConfig:
    """Everything one ``stppo train`` run needs. Saved as ``config.yaml`` in the run folder."""

    algo: str = "st_ppo"
    """Algorithm preset (ppo, turn_ppo, s_ppo, st_ppo, grpo, gspo, so_grpo, or one registered by the user)."""
    algorithm: dict = dataclasses.field(default_factory=dict)
    """Overrides of the preset's fields, e.g. {clip_high: 0.28}. A run's config.yaml holds every resolved field, so
    the run is reproducible from its folder alone (those left to auto stay auto there: see algorithm_resolved)."""
    algorithm_resolved: dict | None = None
    """Written by the trainer into config.yaml: what the algorithm fields left to auto resolved to for the run (a
    resume or replay under other settings resolves them again). Not read."""
    plugins: list = dataclasses.field(default_factory=list)
    """Python modules imported before the algorithm is resolved: they register algorithms, policy losses or
    advantage estimators of your own (`--import MODULE`; installed `stppo.plugins` entry points load by
    themselves)."""
    env: str = "stppo/NQ-v0"
    """Comma-separated env ids; prompts are drawn from their union (e.g. stppo/NQ-v0,stppo/HotpotQA-v0)."""
    env_kwargs: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments for gymnasium.make (dataset, split, retriever, topk, ...), shared by every env id. Search
    envs train on ``split: train`` unless it names another (alone they serve the evaluation split)."""
    share_retriever: bool = True
    """With several processes and a local retriever spec, one process per node serves the index to that node's ranks
    over HTTP (stppo_agent/distributed/shared_retrieval.py)."""
    model: str = ""
    """Actor: a local Hugging Face folder or hub name (with init_from: the reference policy only; unset, the
    checkpoint's actor)."""
    init_from: str | None = None
    """A checkpoint folder (RUN/checkpoints/step-N) whose actor, critic and AdamW state start this run instead of a
    cold optimizer: a new run (iteration 0, its own folder, schedule, seed and prompt order) whose first steps use
    the warm start's moments. Needs the checkpoint's optimizer state (checkpoint_optimizer=all, or its newest
    checkpoint). Read once, at iteration 0: --resume continues from the run's own checkpoints."""
    critic_model: str | None = None
    """Critic backbone (default: the actor's initial weights with a new value head)."""
    output_dir: str = "runs/stppo"
    """Run folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/step-N/."""
    iterations: int = 100
    """Rollout + update iterations."""
    prompts_per_iteration: int = 8
    """Distinct prompts per iteration."""
    samples_per_prompt: int = 1
    """Trajectories per prompt (the GRPO group size; use >= 2 for group-based advantages)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batch_size: int = 8
    """Trajectories per optimizer step."""
    micro_batch_size: int = 4
    """Trajectories per forward/backward (gradient accumulation inside a mini-batch)."""
    generation_batch_size: int = 64
    """Trajectories per transformers generate call (HF backend). Generation is latency-bound on a GPU, so this is
    kept apart from micro_batch_size: measured on an H200, chunks of 8 instead of 32 made rollouts 2.6x slower.
    Lower it if the KV cache of this many contexts does not fit."""
    actor_lr: float = 1e-6
    """Actor learning rate (Search-R1 PPO: 1e-6)."""
    critic_lr: float = 1e-5
    """Critic learning rate (Search-R1 PPO: 1e-5)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps."""
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Gradient-norm clipping, after the clip-bias correction."""
    # Rollout limits: flat here for --set, defaults and meanings from RolloutLimits (the one place they live).
    max_turns: int = RolloutLimits.max_turns
    max_new_tokens_per_turn: int = RolloutLimits.max_new_tokens_per_turn
    max_observation_tokens: int = RolloutLimits.max_observation_tokens
    max_prompt_tokens: int = RolloutLimits.max_prompt_tokens
    max_total_tokens: int = RolloutLimits.max_total_tokens
    temperature: float = 1.0
    """Sampling temperature of the rollouts (0: greedy). The trainer scores old, reference and updated log-probs
    at the same temperature and top_k / top_p (stppo_agent/rollouts/sampling.py), so ratios compare like with like."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the most likely tokens whose probability exceeds top_p (1: off)."""
    top_k: int = 0
    """Sample from the k most likely tokens (0: off); applied before top_p, as transformers and vLLM do."""
    rollout_staleness: int = 0
    """Off-policy stressor: iteration i's rollouts are sampled by the policy as it was K iterations earlier (after
    max(0, i - K) updates), the data an asynchronous trainer's learner receives; the lag is logged as `staleness`
    and kept in checkpoints (stppo_agent/training/stale_policy.py). 0: generation by the current policy."""
    old_logprobs: str = "recompute"
    """The PPO ratio's denominator: recompute (a forward of the behaviour weights before the update, in the
    learner's precision) or sampler (the log-probs the sampler computed while generating, as vLLM-based trainers
    and verl's rollout-log-prob mode take them: no extra forward, and a sampler/learner precision gap then reaches
    the ratio and the clip). With sampler, rollout_correction auto is none (the ratio holds the gap) and tis / mis
    are refused; stale_objective=decoupled needs recomputed log-probs."""
    stale_objective: str = "coupled"
    """With rollout_staleness > 0: coupled (the PPO ratio is taken against the lagged behaviour policy) or
    decoupled (AReaL's decoupled PPO: the ratio against the current weights before the update, the lag as a capped,
    stop-gradient importance weight: rollout_correction, mis unless set, capped at rollout_correction_cap)."""
    probe_every: int = 0
    """Every N iterations the current actor (not a lagged generator) plays probe_prompts fixed prompts; probe/reward,
    probe/invalid_action_rate, probe/policy_version go to metrics.jsonl (stppo_agent/training/probe.py). 0: off."""
    probe_prompts: int = 8
    """Prompts each probe plays: the same ones every time (with samples of their own)."""
    generation_autocast_dtype: str | None = None
    """Off-policy stressor: bfloat16 runs the sampler's forward passes, output head included, under bfloat16
    autocast while scoring and training stay in float32 -- the precision gap between a bfloat16 inference engine
    (vLLM serving a float32-trained policy) and its learner, on the HF backend. The gap is logged as
    rollout_logprob_diff; algorithm.rollout_correction=auto corrects it with TIS, as with vLLM (none leaves it
    uncorrected). Needs dtype=float32 and autocast_dtype unset. None: the sampler computes as the learner."""
    strategy: str = "ddp"
    """Data-parallel strategy under torchrun: ddp (whole model per rank) or fsdp2 (parameters, gradients and
    optimizer state sharded over the ranks by torch.distributed.fsdp.fully_shard; also runs in one process)."""
    fsdp_compute_dtype: str | None = None
    """strategy=fsdp2 only: bfloat16 to gather weights and compute forward/backward in that dtype while
    the sharded master weights and AdamW state stay in `dtype` (float32) and gradients are reduced in float32
    (FSDP2's MixedPrecisionPolicy). None: compute in `dtype`. float16 is refused (no loss scaler)."""
    autocast_dtype: str | None = None
    """bfloat16: run the forward passes (generation, scoring, training) under torch.autocast with float32
    weights, gradients and optimizer state, output heads in float32 (stppo_agent/models/precision.py); faster on
    GPUs and on CPUs with AMX. auto: bfloat16 on a GPU that supports it or a CPU with AMX, else float32
    (config.yaml records the choice). float16 is refused: it needs a loss scaler, which stppo lacks. For
    strategy=fsdp2 use fsdp_compute_dtype instead."""
    reuse_kv_cache: bool = True
    """HF backend: continue each trajectory's key/value cache from its previous turn instead of re-encoding the
    transcript every turn (same tokens; stppo_agent/rollouts/turn_cache.py)."""
    generation_backend: str = "hf"
    """hf (transformers generate) or vllm (colocated vLLM engine, weights synced after every update; GPU only)."""
    vllm_gpu_memory_utilization: float = 0.35
    """Share of GPU memory the vLLM engine may take (the rest is the trainer's)."""
    dtype: str = "float32"
    """float32 or bfloat16 for the models' weights (float16 is refused for training: no loss scaler)."""
    gradient_checkpointing: bool = False
    device: str = "auto"
    """auto (cuda when available), cpu, cuda, cuda:N."""
    seed: int = 0
    save_every: int = 10
    """Checkpoint every N iterations (and always at the end)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    checkpoint_dtype: str | None = None
    """bfloat16 (or float16): write checkpoint weights (actor, critic) in that dtype, half of float32's disk; resume
    loads them back into `dtype` and continues from the rounded weights. None: the weights' own dtype."""
    checkpoint_optimizer: str = "all"
    """all: every kept checkpoint holds the optimizer state (any of them resumes exactly); newest: only the newest
    does (resume needs no other), older ones drop it, two thirds of their size with AdamW (not with rollback);
    none: no checkpoint holds it (weights to evaluate or start a new run from; --resume refuses them)."""
    max_nan_skips: int = 3
    """Consecutive skipped updates (NaN/inf loss or gradient) before the run stops."""
    max_search_error_rate: float = 0.05
    """Stop when more than this share of an iteration's searches failed (a retriever that is down would otherwise
    train the policy on error observations)."""
    save_rollouts: bool = False
    """Record every iteration's batch and the initial weights under rollouts/ for `stppo replay`
    (safetensors + JSON lines; see stppo_agent/runs/recording.py for the format)."""
    step_diagnostics: bool = False
    """Write steps.jsonl: per optimizer step, the gradient's cosine to the iteration's first (on-policy) one,
    token/turn ratio tails, clip shares, ||C|| (measured for every algorithm: one extra backward on off-policy
    steps) and norms. On by default in `stppo replay`."""
    on_collapse: str = "warn"
    """What a collapse alarm does: none (no monitoring), warn (a line and a metrics.jsonl event), stop (checkpoint and
    stop with advice) or rollback (restore the newest healthy checkpoint, scale actor_lr by rollback_lr_factor and go
    on). Signals and rules: stppo_agent/monitoring/collapse_rules.py; README "Collapse early warning"."""
    collapse_window: int = 20
    """Iterations of history each signal is compared with (median and MAD)."""
    collapse_warmup: int = 5
    """Iterations of history a signal needs before it can trip."""
    collapse_z: float = 6.0
    """Robust z-score beyond which a signal trips."""
    collapse_patience: int = 2
    """Consecutive iterations one family of signals must trip to raise an alarm on its own."""
    collapse_min_families: int = 2
    """Families of signals tripping in the same iteration that raise an alarm at once."""
    collapse_drawdown: float = 0.5
    """Share of its running best that the reward's moving average must lose to trip."""
    collapse_thresholds: dict = dataclasses.field(default_factory=lambda: {"kl_to_reference": 1.0})
    """Absolute limits of signals, active from the first iteration (--set collapse_thresholds.KEY=LIMIT)."""
    rollback_lr_factor: float = 0.5
    """on_collapse=rollback: the actor learning rate is multiplied by this at each rollback."""
    max_rollbacks: int = 2
    """on_collapse=rollback: rollbacks before an alarm stops the run instead."""
    tensorboard: bool = True
    wandb_project: str | None = None
    """Log to Weights & Biases too when set (needs `pip install wandb`)."""
    progress: bool = True

    def __post_init__(self):
        if self.init_from and not self.model:  # the warm start's actor is then the reference policy as well
            self.model = str(Path(self.init_from) / "actor")

    def algorithm_config(self) -> AlgorithmConfig:
        load_plugins(self.plugins)
        preset = ALGORITHMS[self.algo]
        unknown = set(self.algorithm) - {f.name for f in dataclasses.fields(AlgorithmConfig)}
        if unknown:
            raise ValueError(unknown_fields("algorithm fields", unknown, [f.name for f in dataclasses.fields(
                AlgorithmConfig)]))
        hints = typing.get_type_hints(AlgorithmConfig)
        values = {key: _coerce(f"algorithm.{key}", value, hints[key]) for key, value in self.algorithm.items()}
        algo = dataclasses.replace(preset, **values)
        if self.old_logprobs == "sampler" and algo.rollout_correction == "auto":
            algo = dataclasses.replace(algo, rollout_correction="none")  # the ratio itself holds the gap
        return resolve_rollout_correction(algo, self.generation_backend, self.generation_autocast_dtype,
                                          decoupled=is_decoupled(self))

    def rollout_limits(self) -> RolloutLimits:
        return RolloutLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RolloutLimits)})

    def sampling(self) -> SamplingSettings:
        """How rollouts sample and the trainer scores; raises naming a bad value."""
        return SamplingSettings(self.temperature, self.top_p, greedy=self.temperature == 0, top_k=self.top_k)

    def validate(self) -> None:
        if not self.model:
            raise ValueError("model is required: a Hugging Face folder or hub name (--model)")
        for name in ("iterations", "prompts_per_iteration", "samples_per_prompt", "ppo_epochs", "mini_batch_size",
                     "micro_batch_size", "generation_batch_size", "save_every", "keep_checkpoints", "probe_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_ranges(self)
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(f"mini_batch_size ({self.mini_batch_size}) must be a multiple of micro_batch_size "
                             f"({self.micro_batch_size})")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be {' or '.join(STRATEGIES)}, got {self.strategy!r}")
        check_precision(self)
        self.sampling()  # a bad temperature / top_p / top_k fails here, before minutes of model loading
        if self.generation_backend not in ("hf", "vllm"):
            raise ValueError(f"generation_backend must be hf or vllm, got {self.generation_backend!r}")
        check_collapse_settings(self)
        check_old_logprobs(self)  # before the staleness checks: its refusal of the decoupled objective says more
        check_staleness(self)
        check_init_from(self)
        from stppo_agent.runs.checkpoint import check_checkpoint_settings

        check_checkpoint_settings(self.checkpoint_dtype, self.checkpoint_optimizer, self.on_collapse)
        from stppo_agent.rollouts.envs import is_search_env

        load_plugins(self.plugins)  # a plugin may register envs as well as algorithms
        for env_id in (e.strip() for e in self.env.split(",") if e.strip()):
            is_search_env(env_id)  # an unknown id fails here, before minutes of model loading
        algo = self.algorithm_config()
        check_dynamic_sampling(algo, self.samples_per_prompt)
        if algo.advantage in GROUP_ESTIMATORS and self.samples_per_prompt < 2:
            raise ValueError(f"algorithm {self.algo} uses group-relative advantages ({algo.advantage}): a group of one "
                             f"trajectory has advantage 0 and nothing is learned; set samples_per_prompt >= 2 "
                             f"(e.g. --set samples_per_prompt=5, Search-R1's GRPO group size)")
        self.rollout_limits().validate()

    def to_yaml(self, resolved: AlgorithmConfig | None = None) -> str:
        """The config as YAML; with ``resolved``, ``algorithm`` holds every field the run used (not only the
        overrides), so the folder reproduces the run even if a preset's defaults change later -- but the fields left
        to ``auto``, which stay ``auto`` beside their values in ``algorithm_resolved``."""
        values = dataclasses.asdict(self)
        if resolved is not None:
            requested = {**dataclasses.asdict(ALGORITHMS[self.algo]), **self.algorithm}
            values["algorithm"], values["algorithm_resolved"] = recorded_algorithm(requested, resolved)
        return yaml.safe_dump(values, sort_keys=False)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None, **flags: Any) -> TrainConfig:
    """Defaults <- YAML file <- explicit flags (those not None) <- ``--set key=value`` overrides."""
    values: dict[str, Any] = {}
    file_algo = None
    if path is not None:
        try:
            loaded = yaml.load(Path(path).read_text(), Loader=NumberLoader) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a config file must hold a mapping of field: value")
        values.update(loaded)
        file_algo = loaded.get("algo")
    values.update({k: v for k, v in flags.items() if v is not None})
    resolved_fields = {f.name for f in dataclasses.fields(AlgorithmConfig)} - {"name"}
    if file_algo is not None and values.get("algo") != file_algo \
            and set(values.get("algorithm") or {}) >= resolved_fields:
        # A run's config.yaml records every field of *its* algorithm; under another --algo those would silently
        # turn the new preset back into the old one. Hand-written partial overrides are kept.
        values["algorithm"] = {}
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects key=value, got {item!r}")
        try:
            value = yaml.load(raw, Loader=NumberLoader)
        except yaml.YAMLError as exc:
            raise ValueError(f"--set {item}: the value is not valid YAML: {exc}") from exc
        if key.startswith(("algorithm.", "env_kwargs.", "collapse_thresholds.")):
            section, _, field = key.partition(".")
            values.setdefault(section, dict(_default(section)))  # one key set: the others keep their defaults
            values[section] = {**values[section], field: value}
        else:
            values[key] = value
    return from_dict(values)


def _default(field: str) -> Any:
    spec = TrainConfig.__dataclass_fields__[field]
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


def from_dict(values: dict[str, Any]) -> TrainConfig:
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    unknown = set(values) - set(fields)
    if unknown:
        raise ValueError(unknown_fields("config fields", unknown, list(fields)))
    hints = typing.get_type_hints(TrainConfig)
    coerced = {key: _coerce(key, value, hints[key]) for key, value in values.items()}
    return TrainConfig(**coerced)


def unknown_fields(kind: str, unknown: set, known: list[str]) -> str:
    """``unknown config fields ['actor_lrr'] (did you mean actor_lr?); known: ...``: each with its closest name."""
    hints = [(name, closest(name, known)) for name in sorted(unknown)]
    hints = [f"{match} for {name}" if len(unknown) > 1 else match for name, match in hints if match]
    suggestion = f" (did you mean {', '.join(hints)}?)" if hints else ""
    return f"unknown {kind} {sorted(unknown)}{suggestion}; known: {', '.join(known)}"


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """YAML gives ints where floats are meant (1e-6 is fine, but 1 is an int); check and convert scalars."""
    base = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    target = base[0]
    if value is None or target in (dict, typing.Any) or typing.get_origin(target) is dict:
        return value
    if target is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if target is bool and isinstance(value, bool) or target is int and isinstance(value, int) \
            and not isinstance(value, bool) or target is str and isinstance(value, str):
        return value
    if target is list and isinstance(value, (list, str)):
        return [value] if isinstance(value, str) else list(value)
    raise ValueError(f"config field {key} expects {getattr(target, '__name__', target)}, got {value!r}")
