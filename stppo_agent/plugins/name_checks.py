"""Names typed on the command line, checked before any model loads: each unknown one is refused in one line with the
closest known name and the list (the rule is :mod:`stppo_envs.suggest`).

The registries and the env registry raise their own errors deeper down; checking here, right after the plugins
are imported (they may register algorithms and envs), answers a typo in a second instead of after a model load.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from stppo_agent.plugins.loader import load_plugins
from stppo_envs.suggest import did_you_mean, unknown_name

# The kinds `stppo_envs.retrieval.make_retriever` reads (kept in step with its SPEC_HELP).
RETRIEVER_KINDS = ("demo", "bm25", "bm25-prebuilt", "dense", "http", "https")


def check_algorithm(name: str) -> None:
    from stppo_agent.algorithms import ALGORITHMS

    if name not in ALGORITHMS:
        raise ValueError(unknown_name("algorithm", name, ALGORITHMS) + "; a plugin's own: --import myrule.py")


def check_env_ids(env: str) -> list[str]:
    """The comma-separated env ids, each registered (the stppo envs register on import)."""
    import gymnasium as gym

    import stppo_envs  # noqa: F401  (registers stppo/...)

    ids = [e.strip() for e in env.split(",") if e.strip()]
    known = [i for i in gym.registry if i.startswith("stppo/")]
    for env_id in ids:
        if env_id not in gym.registry:
            raise ValueError(f"unknown env id {env_id!r}{did_you_mean(env_id, known)}; Registered stppo envs: "
                             f"{', '.join(sorted(known))}")
    return ids


def check_env_kwargs(env_ids: list[str], env_kwargs: dict) -> None:
    """``--set env_kwargs.KEY=...`` against the parameters of each env's constructor."""
    import gymnasium as gym

    for env_id in env_ids:
        entry_point = gym.spec(env_id).entry_point
        try:
            target = gym.envs.registration.load_env_creator(entry_point) if isinstance(entry_point, str) \
                else entry_point
            parameters = inspect.signature(target).parameters
        except (ImportError, AttributeError, TypeError, ValueError):
            continue  # the env's own error will say it when it is built
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            continue
        accepted = [n for n, p in parameters.items() if n != "self" and p.kind is not inspect.Parameter.VAR_POSITIONAL]
        for key in env_kwargs:
            if key not in accepted and key != "render_mode":
                raise ValueError(f"env {env_id!r} does not accept env_kwargs {key!r}"
                                 f"{did_you_mean(key, accepted)}; it accepts: {', '.join(sorted(accepted))}")
    if isinstance(env_kwargs.get("retriever"), str):
        check_retriever(env_kwargs["retriever"])


def check_retriever(spec: str) -> None:
    """The kind of a retriever spec (``bm52:DIR`` -> did you mean bm25?); the rest is the retriever's to judge."""
    spec = spec.strip()
    if spec == "demo":
        return
    kind, sep, rest = spec.partition(":")
    if not sep:
        raise ValueError(f"bad retriever spec {spec!r}{did_you_mean(spec, RETRIEVER_KINDS)}: expected demo, "
                         "bm25:INDEX_DIR, bm25-prebuilt:NAME, dense:INDEX_DIR or http://HOST:PORT")
    if kind not in RETRIEVER_KINDS:
        raise ValueError(unknown_name("retriever kind", kind, RETRIEVER_KINDS) + f" (in {spec!r})")


def check_model(name: str) -> None:
    """A model that is neither a folder nor an alias but is spelt like an alias is a typo, not a hub name."""
    from stppo_agent.models.default_model import MODEL_ALIASES

    name = name.removeprefix("hf:")
    if not name or name.lower() in MODEL_ALIASES or Path(name).expanduser().exists() or "/" in name:
        return
    hint = did_you_mean(name, MODEL_ALIASES)
    if hint:
        raise ValueError(f"model {name!r} is neither a folder nor a known alias{hint}; aliases: "
                         f"{', '.join(sorted(MODEL_ALIASES))}; or give a Hugging Face folder or hub name")


def check_train_config(config) -> None:
    """Every name a ``stppo train`` or ``stppo replay`` config holds, plugins imported first."""
    load_plugins(config.plugins)
    check_algorithm(config.algo)
    ids = check_env_ids(config.env)
    check_env_kwargs(ids, config.env_kwargs or {})
    if config.model:
        check_model(config.model)
