"""The training config: top-level fields and sections (stppo_agent/training/config_sections.py), filled from a YAML
file, then ``--set section.key=value`` overrides (``--set rollout.samples_per_prompt=8``).

Algorithm fields (``clip_high``, ``kl_loss_coef``, ...) default to the chosen preset (``--algo``); the user's
values win: ``--set algorithm.clip_high=0.28`` (or the ``algorithm:`` mapping of the YAML file).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from stppo_agent.algorithms import ALGORITHMS, AlgorithmConfig, recorded_algorithm, resolve_rollout_correction
from stppo_agent.plugins.loader import load_plugins
from stppo_agent.rollouts.sampling import SamplingSettings
from stppo_agent.rollouts.turn_loop import RolloutLimits
from stppo_agent.runs.config_yaml import NumberLoader, migrate_flat
from stppo_agent.training.config_checks import validate
from stppo_agent.training.config_sections import (
    RENAMED,
    SECTIONS,
    CheckpointConfig,
    DistributedConfig,
    LoggingConfig,
    MonitorConfig,
    OptimizerConfig,
    PrecisionConfig,
    RolloutConfig,
)
from stppo_agent.training.stale_policy import is_decoupled
from stppo_envs.suggest import closest


@dataclasses.dataclass
class TrainConfig:
    """Everything one ``stppo train`` run needs. Saved as ``config.yaml`` in the run folder.

    Top level: what the run is -- the algorithm, the envs, the models, the run folder, its length and seed, the
    device. Everything else is in a section (stppo_agent/training/config_sections.py), spelled ``section.key``
    on the command line: ``rollout`` (sampling, limits, backend, off-policy stressors), ``optimizer`` (epochs,
    batch geometry, learning rates), ``precision``, ``checkpoint``, ``monitor`` (collapse alarms, stop
    conditions, the probe), ``distributed`` and ``logging``.
    """

    algo: str = "st_ppo"
    """Algorithm preset (ppo, turn_ppo, s_ppo, st_ppo, grpo, gspo, so_grpo, or one registered by the user)."""
    algorithm: dict = dataclasses.field(default_factory=dict)
    """Overrides of the preset's fields, e.g. {clip_high: 0.28}, and of the rule's own hyper-parameters
    (`stppo train --algo NAME --help` lists them). A run's config.yaml holds every resolved field, so the run is
    reproducible from its folder alone (those left to auto stay auto there: see algorithm_resolved)."""
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
    model: str = ""
    """Actor: a local Hugging Face folder or hub name (with init_from: the reference policy only; unset, the
    checkpoint's actor)."""
    init_from: str | None = None
    """A checkpoint folder (RUN/checkpoints/step-N) whose actor, critic and AdamW state start this run instead of a
    cold optimizer: a new run (iteration 0, its own folder, schedule, seed and prompt order) whose first steps use
    the warm start's moments. Needs the checkpoint's optimizer state (checkpoint.optimizer=all, or its newest
    checkpoint). Read once, at iteration 0: --resume continues from the run's own checkpoints."""
    critic_model: str | None = None
    """Critic backbone (default: the actor's initial weights with a new value head)."""
    output_dir: str = "runs/stppo"
    """Run folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/step-N/."""
    iterations: int = 100
    """Rollout + update iterations."""
    seed: int = 0
    """Seed of every random stream (prompt order, sampling, initialisation)."""
    device: str = "auto"
    """auto (cuda when available), cpu, cuda, cuda:N."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def __setattr__(self, name: str, value) -> None:  # an old flat name would be a silent new attribute
        if name in RENAMED and name not in TrainConfig.__dataclass_fields__:
            raise AttributeError(f"TrainConfig.{name} is now TrainConfig.{RENAMED[name]}")
        super().__setattr__(name, value)

    def __getattr__(self, name: str):  # only for names that are not attributes: an old flat name says where it went
        if name in RENAMED:
            raise AttributeError(f"TrainConfig.{name} is now TrainConfig.{RENAMED[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __post_init__(self):
        for name in SECTIONS:  # a section given as a mapping ({"samples_per_prompt": 8}), checked as --set would
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, _section(name, getattr(self, name)))
        if self.init_from and not self.model:  # the warm start's actor is then the reference policy as well
            self.model = str(Path(self.init_from) / "actor")

    def algorithm_config(self) -> AlgorithmConfig:
        load_plugins(self.plugins)
        algo = resolve_algorithm(ALGORITHMS[self.algo], self.algorithm)
        if self.rollout.old_logprobs == "sampler" and algo.rollout_correction == "auto":
            algo = dataclasses.replace(algo, rollout_correction="none")  # the ratio itself holds the gap
        return resolve_rollout_correction(algo, self.rollout.backend, self.precision.generation_autocast_dtype,
                                          decoupled=is_decoupled(self))

    def rollout_limits(self) -> RolloutLimits:
        return RolloutLimits(**{f.name: getattr(self.rollout, f.name) for f in dataclasses.fields(RolloutLimits)})

    def sampling(self) -> SamplingSettings:
        """How rollouts sample and the trainer scores; raises naming a bad value."""
        rollout = self.rollout
        return SamplingSettings(rollout.temperature, rollout.top_p, greedy=rollout.temperature == 0,
                                top_k=rollout.top_k)

    def validate(self) -> None:
        validate(self)

    def to_yaml(self, resolved: AlgorithmConfig | None = None) -> str:
        """The config as YAML, one mapping per section; with ``resolved``, ``algorithm`` holds every field the run
        used (not only the overrides), so the folder reproduces the run even if a preset's defaults change later --
        but the fields left to ``auto``, which stay ``auto`` beside their values in ``algorithm_resolved``."""
        values = dataclasses.asdict(self)
        if resolved is not None:
            requested = {**dataclasses.asdict(ALGORITHMS[self.algo]), **self.algorithm}
            values["algorithm"], values["algorithm_resolved"] = recorded_algorithm(requested, resolved)
        return yaml.safe_dump(values, sort_keys=False)


TOP_LEVEL = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in SECTIONS)
# top-level fields whose value is a mapping of free keys: --set algorithm.clip_high=0.28, env_kwargs.topk=5
MAPPINGS = ("algorithm", "env_kwargs")


def setting_names() -> list[str]:
    """Every name --set takes, as it is spelled there: top-level fields and ``section.key``."""
    return [*TOP_LEVEL, *(f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls))]


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None, **flags: Any) -> TrainConfig:
    """Defaults <- YAML file <- explicit flags (those not None) <- ``--set key=value`` overrides.

    A file in the flat layout of earlier versions (a run folder's old config.yaml) is read in the grouped one, with
    a note; ``--set`` takes only the grouped names."""
    values: dict[str, Any] = {}
    file_algo = None
    if path is not None:
        try:
            loaded = yaml.load(Path(path).read_text(), Loader=NumberLoader) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a config file must hold a mapping of field: value")
        loaded, moved = migrate_flat(loaded)
        if moved:
            note(f"note: {path} is in the flat layout of earlier stppo versions; read with the grouped names "
                 f"({', '.join(f'{old} -> {RENAMED[old]}' for old in moved[:3])}{', ...' if len(moved) > 3 else ''})")
        values.update(loaded)
        file_algo = loaded.get("algo")
    values.update({k: v for k, v in flags.items() if v is not None})
    resolved_fields = {f.name for f in dataclasses.fields(AlgorithmConfig)} - {"name", "hyperparameters"}
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
        set_value(values, key.strip(), value)
    return from_dict(values)


def note(message: str) -> None:
    """One line on stderr, from the main process only."""
    from stppo_agent.distributed import process_group

    if process_group.is_main():
        print(message, file=sys.stderr)


def set_value(values: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted ``key`` (``rollout.samples_per_prompt``, ``algorithm.clip_high``,
    ``monitor.thresholds.kl_to_reference``) in the nested mapping ``values``; a flat name of earlier versions or
    an unknown key raises, naming the right one."""
    head, _, rest = key.partition(".")
    check_key(key)
    if head in SECTIONS:
        section = values.setdefault(head, {})
        if not isinstance(section, dict):
            raise ValueError(f"config field {head} must be a mapping, got {section!r}")
        field, _, inner = rest.partition(".")
        if inner:  # a key of a mapping inside a section: monitor.thresholds.kl_to_reference
            default = getattr(SECTIONS[head](), field)
            section[field] = {**(section.get(field) or default), inner: value}
        else:
            section[field] = value
    elif rest:  # algorithm.clip_high, env_kwargs.topk: one key set, the others keep theirs
        values[head] = {**(values.get(head) or _default(head)), rest: value}
    else:
        values[head] = value


def check_key(key: str) -> None:
    """Raise ValueError for a --set key that names no setting: an old flat name says where it went, anything else
    gets the closest known name."""
    head, _, rest = key.partition(".")
    if head in RENAMED and head not in TOP_LEVEL:
        raise ValueError(f"{head!r} is now {RENAMED[head]!r}" + (f" (--set {RENAMED[head]}.{rest}=...)" if rest else
                                                                  f" (--set {RENAMED[head]}=...)"))
    if head in MAPPINGS and rest:
        return
    if head in SECTIONS:
        field, _, inner = rest.partition(".")
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[head])}
        if field in fields and (not inner or fields[field].type in ("dict", dict)):
            return
    elif head in TOP_LEVEL and not rest:
        return
    raise ValueError(unknown_key(key))


def unknown_key(key: str) -> str:
    """``unknown key 'rollout.sample_per_prompt'; did you mean 'rollout.samples_per_prompt'?``"""
    names = setting_names()
    head, _, rest = key.partition(".")
    # the closest full name, or the one whose last part is closest (a key in the wrong section, or none)
    last = rest.rpartition(".")[2] or head
    match = next((n for n in names if n.rpartition(".")[2] == last and n != key), None)  # the key, in another section
    match = match or closest(key, names) or closest(last, [n.rpartition(".")[2] for n in names])
    if match and "." not in match:
        match = next((n for n in names if n.rpartition(".")[2] == match), match)
    hint = f"; did you mean {match!r}?" if match else ""
    where = (f"; section {head} holds {', '.join(f.name for f in dataclasses.fields(SECTIONS[head]))}"
             if head in SECTIONS and not match else "")
    return f"unknown key {key!r}{hint}{where} (stppo train --help lists every key)"


def _default(field: str) -> Any:
    spec = TrainConfig.__dataclass_fields__[field]
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


def from_dict(values: dict[str, Any]) -> TrainConfig:
    """The config of a nested mapping as YAML holds it (``{"rollout": {"samples_per_prompt": 8}}``); dotted keys
    (``{"rollout.samples_per_prompt": 8}``) are taken too. Names are checked as ``--set``'s are."""
    nested: dict[str, Any] = {}
    for key, value in values.items():
        if "." in key:
            set_value(nested, key, value)
        elif key in SECTIONS:
            if value is None:
                continue
            if dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            if not isinstance(value, dict):
                raise ValueError(f"config field {key} must be a mapping of {key}.KEY: value, got {value!r}")
            for inner, inner_value in value.items():
                check_key(f"{key}.{inner}")
            nested[key] = {**nested.get(key, {}), **value}
        else:
            check_key(key)
            nested[key] = value
    hints = typing.get_type_hints(TrainConfig)
    top = {key: _coerce(key, value, hints[key]) for key, value in nested.items() if key not in SECTIONS}
    sections = {name: _section(name, nested.get(name) or {}) for name in SECTIONS}
    return TrainConfig(**top, **sections)


def _section(name: str, values: dict[str, Any]):
    for key in values:
        check_key(f"{name}.{key}")
    cls = SECTIONS[name]
    hints = typing.get_type_hints(cls)
    return cls(**{key: _coerce(f"{name}.{key}", value, hints[key]) for key, value in values.items()})


def resolve_algorithm(preset: AlgorithmConfig, overrides: dict[str, Any]) -> AlgorithmConfig:
    """``preset`` with the user's ``overrides`` (fields of AlgorithmConfig, or hyper-parameters its rules
    declare), each checked and coerced to its type."""
    from stppo_agent.algorithms.hyperparameters import resolve_hyperparameters, split_overrides

    fields, declared = split_overrides(preset, overrides)
    hints = typing.get_type_hints(AlgorithmConfig)
    values = {key: _coerce(f"algorithm.{key}", value, hints[key]) for key, value in fields.items()}
    return resolve_hyperparameters(dataclasses.replace(preset, **values), declared)


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


def merged(*layers: dict[str, Any]) -> dict[str, Any]:
    """Nested config mappings laid over one another: a section's keys are merged one by one
    (``merged({"rollout": {"max_turns": 2}}, {"rollout": {"top_k": 5}})`` keeps both), any other key replaced."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key in SECTIONS and isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = {**out[key], **value}
            else:
                out[key] = value
    return out
