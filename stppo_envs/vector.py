"""A batched ``VectorEnv`` over :class:`SearchQAEnv` copies that serves all searches of a step in one call.

Rollouts of many trajectories issue many searches per turn; one ``batch_search`` call lets pyserini and faiss
use their batched paths (and a remote server one request). Autoreset follows Gymnasium's default
``NEXT_STEP`` mode: the step after an episode ends resets that sub-env and ignores its action.
"""

from __future__ import annotations

from typing import Any, Sequence

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from .actions import ParsedAction
from .env import SearchQAEnv, sanitize_query
from .retrieval.base import Hit, RetrievalError, search_each
from .retrieval.factory import make_retriever


class SearchQAVectorEnv(VectorEnv):
    """``num_envs`` copies of one env spec sharing a single retriever."""

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP, "render_modes": []}

    def __init__(self, envs: Sequence[SearchQAEnv]):
        if not envs:
            raise ValueError("a vector env needs at least one env")
        if len({env.topk for env in envs}) != 1:
            raise ValueError("all sub-envs of a vector env must use the same topk")
        self.envs = list(envs)
        self.num_envs = len(self.envs)
        self.retriever = self.envs[0].retriever
        for env in self.envs:
            env.retriever = self.retriever
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self._needs_reset = np.ones(self.num_envs, dtype=bool)

    def reset(self, *, seed: int | Sequence[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[tuple[str, ...], dict]:
        """``seed`` may be one int (sub-env i gets seed + i) or one per env; ``options["indices"]`` picks examples."""
        seeds = _per_env_seeds(seed, self.num_envs)
        options = dict(options or {})
        indices = options.pop("indices", None)
        if indices is not None and len(indices) != self.num_envs:
            raise ValueError(f"options['indices'] needs {self.num_envs} entries, got {len(indices)}")
        observations, infos = [], {}
        for i, env in enumerate(self.envs):
            env_options = dict(options, index=indices[i]) if indices is not None else options
            obs, info = env.reset(seed=seeds[i], options=env_options)
            observations.append(obs)
            infos = self._add_info(infos, info, i)
        self._needs_reset[:] = False
        return tuple(observations), infos

    def step(self, actions: Sequence[str]) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, dict]:
        if len(actions) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} actions, got {len(actions)}")
        parsed = {i: env.begin_step(actions[i]) for i, env in enumerate(self.envs) if not self._needs_reset[i]}
        hits, errors = serve_searches(self.retriever, self.envs[0].topk,
                                      {i: p for i, p in parsed.items() if self.envs[i].needs_search(p)})
        observations: list[str] = []
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminated = np.zeros(self.num_envs, dtype=bool)
        truncated = np.zeros(self.num_envs, dtype=bool)
        infos: dict = {}
        for i, env in enumerate(self.envs):
            if self._needs_reset[i]:
                obs, info = env.reset()
                self._needs_reset[i] = False
            else:
                obs, rewards[i], terminated[i], truncated[i], info = env.finish_step(
                    actions[i], parsed[i], hits.get(i), errors.get(i))
                self._needs_reset[i] = terminated[i] or truncated[i]
            observations.append(obs)
            infos = self._add_info(infos, info, i)
        return tuple(observations), rewards, terminated, truncated, infos

    def close_extras(self, **kwargs: Any) -> None:
        for env in self.envs:
            env.close()


def serve_searches(retriever, topk: int, pending: dict[int, ParsedAction]
                   ) -> tuple[dict[int, list[Hit]], dict[int, RetrievalError]]:
    """Serve the search actions of many envs with one ``batch_search``; a failure is reported for each of them."""
    if not pending:
        return {}, {}
    # search_each isolates a query the backend refuses in a few calls (a partial answer from a server is kept
    # as it came), while a backend that is down fails every search alike.
    keys = list(pending)
    rows, errors = search_each(retriever, [sanitize_query(pending[i].content) for i in keys], topk)
    return ({key: rows[j] for j, key in enumerate(keys) if j not in errors},
            {keys[j]: error for j, error in errors.items()})


def step_envs(envs: Sequence[gym.Env], actions: Sequence[str]) -> list[tuple]:
    """Step several independent envs at once; the searches of all :class:`SearchQAEnv` among them that share
    a retriever and top-k go out as one ``batch_search``. Other envs are stepped plainly."""
    results: list[tuple | None] = [None] * len(envs)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, env in enumerate(envs):
        if isinstance(env, SearchQAEnv):
            groups.setdefault((id(env.retriever), env.topk), []).append(i)
        else:
            results[i] = env.step(actions[i])
    for members in groups.values():
        parsed = {i: envs[i].begin_step(actions[i]) for i in members}
        first = envs[members[0]]
        hits, errors = serve_searches(first.retriever, first.topk,
                                      {i: p for i, p in parsed.items() if envs[i].needs_search(p)})
        for i in members:
            results[i] = envs[i].finish_step(actions[i], parsed[i], hits.get(i), errors.get(i))
    return results  # type: ignore[return-value]


def _per_env_seeds(seed: int | Sequence[int | None] | None, n: int) -> list[int | None]:
    if seed is None:
        return [None] * n
    if isinstance(seed, (int, np.integer)):
        return [int(seed) + i for i in range(n)]
    if len(seed) != n:
        raise ValueError(f"expected {n} seeds, got {len(seed)}")
    return list(seed)


def make_vec(env_id: str, num_envs: int, **kwargs: Any) -> SearchQAVectorEnv:
    """``num_envs`` copies of a registered env sharing one retriever (built once from ``retriever=``)."""
    if num_envs < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    spec = gym.spec(env_id)
    retriever = make_retriever(kwargs.pop("retriever", spec.kwargs.get("retriever", "demo")))
    envs = [gym.make(env_id, retriever=retriever, disable_env_checker=True, **kwargs).unwrapped
            for _ in range(num_envs)]
    return SearchQAVectorEnv(envs)
