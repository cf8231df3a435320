"""Envs by id, with errors that say what to fix: an unknown id lists the registered ones, a wrong ``env_kwargs`` key
or value names the env."""

from __future__ import annotations

import gymnasium as gym


def _unknown_env(env_id: str, exc: Exception) -> ValueError:
    known = ", ".join(sorted(i for i in gym.registry if i.startswith("stppo/")))
    return ValueError(f"env {env_id!r}: {exc} Registered stppo envs: {known}")


def is_search_env(env_id: str) -> bool:
    try:
        entry_point = gym.spec(env_id).entry_point
    except gym.error.Error as exc:
        raise _unknown_env(env_id, exc) from exc
    return isinstance(entry_point, str) and entry_point.endswith(":SearchQAEnv")


def make_env(env_id: str, kwargs: dict) -> gym.Env:
    """``gym.make`` with errors that say what to fix (an unknown id, a wrong ``env_kwargs`` key or value)."""
    try:
        return gym.make(env_id, disable_env_checker=True, **kwargs).unwrapped
    except gym.error.Error as exc:
        raise _unknown_env(env_id, exc) from exc
    except TypeError as exc:
        raise ValueError(f"env {env_id!r} does not accept env_kwargs {kwargs}: {str(exc).split(' was raised')[0]}") \
            from exc
