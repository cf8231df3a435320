"""Envs by id, with errors that say what to fix: an unknown id lists the registered ones, a wrong ``env_kwargs`` key
or value names the env."""

from __future__ import annotations

from typing import Mapping

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


def prompt_count(env: gym.Env) -> int:
    """How many distinct prompts ``env.reset(options={"index": i})`` poses: a dataset env's examples, a synthetic
    env's ``prompt_count`` (``stppo/Toy-v0``'s targets, ``stppo/Copy-v0``'s indexed sequences), else 1. The samples
    of one prompt (a GRPO group) are reset with the same index, so they pose the same question."""
    base = env.unwrapped  # Gymnasium's wrappers do not forward attributes
    examples = getattr(base, "examples", None)
    if examples is not None:
        return len(examples) or 1
    return max(1, int(getattr(base, "prompt_count", 1)))


def is_real_dataset(source: str | None) -> bool:
    """A dataset other than the bundled demo set (``None``, ``""`` and ``"demo"`` name the demo set)."""
    return source not in (None, "", "demo")


def refuse_real_data_without_retriever(sources: Mapping[str, str | None], retriever: str | None, *,
                                       retriever_option: str = "--retriever", pass_as: str = "--retriever ") -> None:
    """Real data with no retriever named would be searched in the default demo corpus, a fictional encyclopedia
    that cannot answer it, and every score would measure that silently: refused, naming the fix.

    ``sources``: how the user named each dataset (``--dataset nq=...``) -> its source; ``retriever``: the spec
    given, None when none was; ``retriever_option`` / ``pass_as``: how the command names and takes a retriever."""
    real = [label for label, source in sources.items() if is_real_dataset(source)]
    if retriever is None and real:
        raise ValueError(f"{real[0]} is real data, but no {retriever_option} was given: the default demo corpus (a "
                         f"fictional encyclopedia) cannot answer it. Pass {pass_as}bm25:DIR, dense:DIR or "
                         f"http://HOST:PORT (stppo index bm25 --corpus ... builds one), or {pass_as}demo to search "
                         "the demo corpus anyway")


def refuse_training_data_without_retriever(env: str, env_kwargs: Mapping) -> None:
    """:func:`refuse_real_data_without_retriever` for ``stppo train``'s ``env_kwargs`` (search envs only: the
    dataset and retriever of other envs mean what those envs make of them)."""
    if not any(is_search_env(env_id.strip()) for env_id in env.split(",") if env_id.strip()):
        return
    dataset = env_kwargs.get("dataset")
    refuse_real_data_without_retriever({f"env_kwargs.dataset={dataset}": dataset}, env_kwargs.get("retriever"),
                                       retriever_option="env_kwargs.retriever", pass_as="--set env_kwargs.retriever=")
