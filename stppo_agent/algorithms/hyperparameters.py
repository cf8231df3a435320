"""What each update rule reads: the :class:`~stppo_agent.algorithms.config.AlgorithmConfig` fields a registered
policy loss or advantage estimator declares, and hyper-parameters of its own that a plugin's rule defines with a
default and a help line.

    @register_policy_loss("my_loss", reads=("clip_low", "clip_high"),
                          hyperparameters=[Hyperparameter("beta", 0.1, "weight of my extra term")])
    def my_loss(..., config, **_):
        beta = config.hyperparameter("beta")

``--set algorithm.beta=0.3`` sets it; ``stppo train --algo NAME --help`` lists what the preset's rules read
(:mod:`stppo_agent.cli.settings_help`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping


@dataclasses.dataclass(frozen=True)
class Hyperparameter:
    """A hyper-parameter a rule defines for itself: its name (``--set algorithm.NAME=...``), default and help."""

    name: str
    default: Any
    help: str = ""


@dataclasses.dataclass(frozen=True)
class Declaration:
    reads: tuple[str, ...] = ()
    hyperparameters: tuple[Hyperparameter, ...] = ()


# ("policy loss" | "advantage estimator", registered name) -> what it declared
DECLARATIONS: dict[tuple[str, str], Declaration] = {}


def declare(kind: str, name: str, reads: Iterable[str], hyperparameters: Iterable[Hyperparameter],
            fields: Iterable[str]) -> None:
    """Record what the rule ``name`` reads; a field not among ``fields`` (AlgorithmConfig's), or a hyper-parameter
    that shadows one, raises."""
    fields = set(fields)
    reads, own = tuple(reads), tuple(hyperparameters)
    unknown = [field for field in reads if field not in fields]
    if unknown:
        raise ValueError(f"{kind} {name!r} reads {unknown}, which AlgorithmConfig lacks: declare them as "
                         "hyperparameters=[Hyperparameter(NAME, DEFAULT, HELP)]")
    for parameter in own:
        if not isinstance(parameter, Hyperparameter):
            raise TypeError(f"{kind} {name!r}: hyperparameters must be Hyperparameter(...), got {parameter!r}")
        if parameter.name in fields:
            raise ValueError(f"{kind} {name!r}: hyper-parameter {parameter.name!r} is already an AlgorithmConfig "
                             "field; list it in reads= instead")
    DECLARATIONS[(kind, name)] = Declaration(reads, own)


def rule_declarations(algo) -> list[tuple[str, str, Declaration]]:
    """(kind, name, declaration) of the policy loss and the advantage estimator ``algo`` uses."""
    rules = [("policy loss", algo.policy_loss), ("advantage estimator", algo.advantage)]
    return [(kind, name, DECLARATIONS.get((kind, name), Declaration())) for kind, name in rules]


def declared_hyperparameters(algo) -> dict[str, Hyperparameter]:
    return {p.name: p for _, _, d in rule_declarations(algo) for p in d.hyperparameters}


def split_overrides(preset, overrides: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The user's ``algorithm`` overrides as (AlgorithmConfig fields, the rules' own hyper-parameters); a key that
    is neither raises with the closest known name."""
    from stppo_envs.suggest import closest

    fields = [f.name for f in dataclasses.fields(type(preset))]
    rules = dataclasses.replace(preset, **{k: overrides[k] for k in ("policy_loss", "advantage") if k in overrides})
    declared = declared_hyperparameters(rules)
    own = dict(overrides.get("hyperparameters") or {})
    own.update({k: v for k, v in overrides.items() if k in declared})
    unknown = sorted(set(overrides) - set(fields) - set(declared) | set(own) - set(declared))
    if unknown:
        known = [*fields, *declared]
        hints = [closest(name, known) for name in unknown]
        hint = f" (did you mean {', '.join(h for h in hints if h)}?)" if any(hints) else ""
        raise ValueError(f"unknown algorithm fields {unknown}{hint}; known: {', '.join(known)}")
    return {k: v for k, v in overrides.items() if k in fields and k != "hyperparameters"}, own


def resolve_hyperparameters(algo, values: Mapping[str, Any]):
    """``algo`` holding every hyper-parameter its rules declare: the default, the preset's value, then ``values``
    (each converted to its default's type)."""
    declared = declared_hyperparameters(algo)
    resolved = {name: p.default for name, p in declared.items()}
    resolved.update({k: v for k, v in algo.hyperparameters if k in declared})
    for name, value in values.items():
        default = declared[name].default
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if default is not None and not isinstance(value, type(default)):
            raise ValueError(f"algorithm.{name} expects {type(default).__name__}, got {value!r}")
        resolved[name] = value
    return dataclasses.replace(algo, hyperparameters=tuple(sorted(resolved.items())))
