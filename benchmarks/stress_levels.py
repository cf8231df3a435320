"""The stress grid's tiers and levels, and a level's exact `stppo train` options.

A level varies one thing against its matched control at the tier's fixed learning rate (``lr_scale`` and
``critic_lr_scale`` stay knobs, 1 in every default level). Knobs every level has (defaults in :data:`BASE`):

- ``ppo_epochs`` x ``mini_batches``: optimizer steps per iteration; ``mini_batches`` splits the run's *actual*
  batch (prompts_per_iteration x samples_per_prompt after the tier's options and --set), refused when it does not
  divide it;
- ``lr_scale`` / ``critic_lr_scale``: x the tier's actor / critic learning rate (the critic moves only when a
  level says so);
- ``rollout.staleness`` K: the run trains N + K iterations and its rollout read-outs are iterations K .. K+N-1
  (policy versions 0 .. N-1: iteration i samples with the weights after max(0, i - K) updates);
- ``matches: LEVEL``: the step-matched on-policy control of a reuse level E x M: the same number of optimizer
  steps on the same mini-batch size, each on fresh rollouts -- prompts_per_iteration / M prompts an iteration,
  one step each, E x M times the iterations (and the probe interval);
- ``versions`` / ``probe_every``: the level's own read-out count (N) and probe interval, in place of the grid's (the
  reuse levels read out fewer, denser versions: their control's iterations are E x M times theirs); a step-matched
  control takes its reuse level's;
- ``control: LEVEL``: the level this one is compared with (same rule, same seeds); ``only: a+b``: the rules the
  level applies to (the clip-bias levels concern s_ppo and st_ppo alone);
- any other key is a training option, passed as ``--set key=value`` (``algorithm.clip_ratio_c=3``, ...).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from stress_tiers import Tier

BASE = {"ppo_epochs": 1, "mini_batches": 1, "lr_scale": 1, "critic_lr_scale": 1}
META = ("ppo_epochs", "mini_batches", "lr_scale", "critic_lr_scale", "matches", "control", "only", "versions",
        "probe_every")

# Least stress first within each ladder. The mechanism levels (sampler_bf16, dualclip, bias_after) need the
# training options old_logprobs, algorithm.clip_ratio_c and algorithm.clip_bias_order: a grid refuses them, naming
# the option, on a stppo that lacks it.
LADDER = {
    "lag0": {"rollout.staleness": 0},
    "lag4": {"rollout.staleness": 4, "control": "lag0"},
    "lag16": {"rollout.staleness": 16, "control": "lag0"},
    "lag32": {"rollout.staleness": 32, "control": "lag0"},
    "lag64": {"rollout.staleness": 64, "control": "lag0"},
    "reuse2x4": {"ppo_epochs": 2, "mini_batches": 4, "control": "steps8", "versions": 40, "probe_every": 1},
    "steps8": {"matches": "reuse2x4"},
    "reuse4x4": {"ppo_epochs": 4, "mini_batches": 4, "control": "steps16", "versions": 20, "probe_every": 1},
    "steps16": {"matches": "reuse4x4"},
    # the ratio's denominator from a bfloat16 sampler, uncorrected, on-policy otherwise: the precision gap reaches
    # the clip ("phantom clipping")
    "sampler_bf16": {"rollout.old_logprobs": "sampler", "precision.generation_autocast_dtype": "bfloat16",
                     "algorithm.rollout_correction": "none", "control": "lag0"},
    "dualclip": {"rollout.staleness": 32, "algorithm.clip_ratio_c": 3, "control": "lag32"},
    "bias_after": {"rollout.staleness": 32, "algorithm.clip_bias_order": "after_grad_clip", "control": "lag32",
                   "only": "s_ppo+st_ppo"},
}
DEFAULT_LEVELS = ["lag0", "lag16", "lag64", "reuse4x4", "steps16"]
# --quick: the same ladders at tiny sizes
QUICK = {
    "lag2": {"rollout.staleness": 2, "control": "lag0"},
    "reuse2x2": {"ppo_epochs": 2, "mini_batches": 2, "control": "steps4"},
    "steps4": {"matches": "reuse2x2"},
}
QUICK_LEVELS = ["lag0", "lag2", "reuse2x2", "steps4"]
# Earlier grids' levels (docs/stability.md's history), runnable by name, on no default ladder: they move the learning
# rate with the off-policy dose, and lr_only is not step-matched.
HISTORY = {
    "none": {},
    "mild": {"ppo_epochs": 2, "mini_batches": 4},
    "strong": {"ppo_epochs": 4, "mini_batches": 4, "lr_scale": 10},
    "stale": {"ppo_epochs": 4, "mini_batches": 4, "lr_scale": 10, "rollout.staleness": 4},
    "extreme": {"ppo_epochs": 4, "mini_batches": 4, "lr_scale": 100},
    "lr_only": {"lr_scale": 100},
    "mismatch": {"precision.generation_autocast_dtype": "bfloat16", "algorithm.rollout_correction": "none"},
    "strong_mismatch": {"ppo_epochs": 4, "mini_batches": 4, "lr_scale": 10,
                        "precision.generation_autocast_dtype": "bfloat16",
                        "algorithm.rollout_correction": "none"},
}


def known_levels() -> dict[str, dict]:
    return {name: {**BASE, **knobs} for table in (HISTORY, LADDER, QUICK) for name, knobs in table.items()}


def parse_level(spec: str, levels: dict[str, dict] | None = None) -> tuple[str, dict]:
    """``lag8:rollout.staleness=8,control=lag0`` -> ("lag8", {...}); values read as YAML would; unnamed knobs keep
    the named level's (or :data:`BASE`'s) values."""
    name, sep, body = spec.partition(":")
    if not sep or not name:
        raise SystemExit(f"--level expects NAME:knob=value,..., got {spec!r}")
    knobs = dict((levels or known_levels()).get(name, BASE))
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--level {spec}: {item!r} is not knob=value")
        knobs[key.strip()] = yaml.safe_load(value)
    return name, knobs


def effective(sets: list[str], key: str, default=None):
    """The value ``stppo train`` will use for ``key`` given ``--set`` items in order (the last one wins)."""
    value = default
    for item in sets:
        name, _, raw = item.partition("=")
        if name == key:
            value = yaml.safe_load(raw)
    return value


@dataclasses.dataclass(frozen=True)
class Plan:
    """A level resolved against a run's options: its exact options, and how its read-outs align with versions."""
    sets: list
    versions: int
    iterations: int
    staleness: int
    scale: int  # iterations per read-out (the step-matched controls': E x M of the level they match)
    steps_per_iteration: int
    actor_lr: float
    critic_lr: float


def plan(tier: Tier, levels: dict[str, dict], name: str, base: list[str], versions: int) -> Plan:
    """Level ``name``'s `stppo train` options after ``base`` (the tier's and --set's, which they override) and the
    run's length for ``versions`` read-outs (unless the level, or the level it matches, sets its own)."""
    knobs = levels[name]
    scale, prompts = 1, int(effective(base, "rollout.prompts_per_iteration", 8))
    own = levels[knobs["matches"]] if "matches" in knobs else knobs
    versions = int(own.get("versions", versions))
    probe_every = int(own.get("probe_every", effective(base, "monitor.probe_every", 0)))
    if "matches" in knobs:
        matched = levels[knobs["matches"]]
        divisor, scale = int(matched["mini_batches"]), int(matched["ppo_epochs"]) * int(matched["mini_batches"])
        if prompts % divisor:
            raise SystemExit(f"level {name} matches {knobs['matches']}: rollout.prompts_per_iteration={prompts} does "
                             f"not split into its {divisor} mini-batches; use a multiple of {divisor}")
        prompts //= divisor
    batch = prompts * int(effective(base, "rollout.samples_per_prompt", 1))
    minis = int(knobs["mini_batches"])
    if batch % minis:
        raise SystemExit(f"level {name}: mini_batches={minis} does not divide the run's batch of {batch} "
                         f"trajectories (prompts_per_iteration x samples_per_prompt); choose a divisor of {batch}")
    mini = batch // minis
    actor_lr = tier.base_lr * float(knobs["lr_scale"])
    critic_lr = tier.critic_lr * float(knobs["critic_lr_scale"])
    staleness = int(knobs.get("rollout.staleness", 0))
    sets = [f"optimizer.epochs={knobs['ppo_epochs']}", f"rollout.prompts_per_iteration={prompts}",
            f"optimizer.mini_batch_size={mini}", f"optimizer.micro_batch_size={math.gcd(mini, tier.micro)}",
            f"optimizer.actor_lr={actor_lr:g}", f"optimizer.critic_lr={critic_lr:g}"]
    sets += [f"{k}={v}" for k, v in knobs.items() if k not in META]
    if probe_every:
        sets.append(f"monitor.probe_every={probe_every * scale}")
    return Plan(sets, versions, staleness + scale * versions, staleness, scale, int(knobs["ppo_epochs"]) * minis,
                actor_lr, critic_lr)


def missing_options(sets: list[str]) -> list[str]:
    """The keys of ``sets`` this stppo's TrainConfig / AlgorithmConfig does not have (options a level needs that
    are not built yet)."""
    from stppo_agent.algorithms import AlgorithmConfig
    from stppo_agent.training.config import MAPPINGS, setting_names

    train = set(setting_names())
    algo = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    missing = []
    for item in sets:
        key = item.partition("=")[0]
        section, dot, field = key.partition(".")
        if (section == "algorithm" and field not in algo) or (section not in MAPPINGS and key not in train
                                                              and not key.startswith("monitor.thresholds.")):
            missing.append(key)
    return missing


def has_option(name: str) -> bool:
    return not missing_options([f"{name}=x"])
