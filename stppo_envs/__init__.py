"""stppo_envs: turn-structured, Gymnasium-style search-QA environments.

``import stppo_envs`` registers one id per benchmark (``stppo/NQ-v0``, ``stppo/HotpotQA-v0``,
``stppo/MedQA-v0``, ... and the generic ``stppo/SearchQA-v0``), all :class:`SearchQAEnv`, and the toy env
``stppo/Toy-v0`` (:class:`ToyTargetEnv`)::

    env = gymnasium.make("stppo/NQ-v0", dataset="nq_test.jsonl", retriever="bm25:indexes/wiki18", topk=3)

Each env class's docstring (and docs/envs.md) documents it as Gymnasium documents its own envs: Action Space,
Observation Space, Rewards, Starting State, Episode End, Information (turn boundaries included), Arguments and
Version History.
"""

from __future__ import annotations

import gymnasium

from .copy_task import COPY_ENV_ID
from .data.loading import BENCHMARKS, benchmark_info, load_examples
from .data.schema import DatasetFormatError, Example
from .env import SearchQAEnv, Segment
from .toy import ToyTargetEnv
from .vector import SearchQAVectorEnv, make_vec, step_envs

__version__ = "0.1.0"

ENV_VERSION = 0
"""Bump when reward or turn semantics change (Gymnasium's versioning rule)."""


def env_id(benchmark: str) -> str:
    """The registered id of a benchmark, e.g. ``env_id("nq") == "stppo/NQ-v0"``."""
    return f"stppo/{benchmark_info(benchmark).env_name}-v{ENV_VERSION}"


TOY_ENV_ID = f"stppo/Toy-v{ENV_VERSION}"
"""A tiny multi-turn env for learning tests and quick trainer checks (see ``stppo_envs.toy``)."""


def registered_ids() -> list[str]:
    """The id of every benchmark env this package registers (the toy env is ``TOY_ENV_ID``)."""
    return [env_id(name) for name in BENCHMARKS]


def _register_all() -> None:
    for name in BENCHMARKS:
        if env_id(name) not in gymnasium.registry:
            gymnasium.register(id=env_id(name), entry_point="stppo_envs.env:SearchQAEnv",
                               kwargs={"benchmark": name})
    if TOY_ENV_ID not in gymnasium.registry:
        gymnasium.register(id=TOY_ENV_ID, entry_point="stppo_envs.toy:ToyTargetEnv")
    if COPY_ENV_ID not in gymnasium.registry:
        gymnasium.register(id=COPY_ENV_ID, entry_point="stppo_envs.copy_task:CopyEnv")


_register_all()

__all__ = [
    "BENCHMARKS", "DatasetFormatError", "Example", "SearchQAEnv", "SearchQAVectorEnv", "Segment", "TOY_ENV_ID",
    "ToyTargetEnv", "benchmark_info", "env_id", "load_examples", "make_vec", "registered_ids", "step_envs",
]
