"""What a TRL user passes to ``GRPOTrainer``: an ``environment_factory`` for any ``stppo/*`` search env
(:func:`search_environment`), or a dict of them for TRL's multi-environment mode, and the ``train_dataset`` that
routes each row to one question (:func:`training_dataset`).

    factory = search_environment("stppo/NQ-v0", retriever="bm25:indexes/wiki18", split="train")
    trainer = GRPOTrainer(model=..., train_dataset=training_dataset(factory), environment_factory=factory,
                          args=GRPOConfig(max_tool_calling_iterations=factory.max_turns, ...))
"""

from __future__ import annotations

from typing import Any, Mapping

from stppo_agent.rollouts.envs import is_search_env, make_env
from stppo_envs.retrieval.factory import make_retriever

from .environment import TOOL_MCQ_TEMPLATE, TOOL_TEMPLATE, SearchEnvironment


class SearchEnvironmentFactory:
    """Makes one :class:`SearchEnvironment` per call, all on the same env settings and one shared retriever (a
    BM25 searcher, faiss index or server client opened once, not once per rollout). ``len(factory)`` is the
    number of questions; ``max_turns`` the env's turn budget (a sensible ``max_tool_calling_iterations``)."""

    def __init__(self, env_id: str, **env_kwargs: Any):
        if not is_search_env(env_id):
            raise ValueError(f"{env_id!r} is not a search-QA env: the TRL adapter serves the stppo/* benchmark envs "
                             "(stppo_envs.registered_ids())")
        env_kwargs.setdefault("template", TOOL_TEMPLATE)
        env_kwargs.setdefault("mcq_template", TOOL_MCQ_TEMPLATE)
        env_kwargs["retriever"] = make_retriever(env_kwargs.get("retriever", "demo"))
        self.env_id, self.env_kwargs = env_id, env_kwargs
        probe = self._make()  # a wrong setting or dataset fails here, before any trainer is built
        self.max_turns, self._size = probe.max_turns, len(probe.examples)

    def __call__(self) -> SearchEnvironment:
        return SearchEnvironment(self._make())

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"SearchEnvironmentFactory({self.env_id!r}, {self._size} questions, max_turns={self.max_turns})"

    def _make(self):
        return make_env(self.env_id, self.env_kwargs)


def search_environment(env_id: str, **env_kwargs: Any) -> SearchEnvironmentFactory:
    """An ``environment_factory`` for the search env ``env_id`` (``stppo/NQ-v0``, ``stppo/HotpotQA-v0``,
    ``stppo/MedQA-v0``, ...). ``env_kwargs`` are :class:`stppo_envs.SearchQAEnv`'s (``dataset``, ``split``,
    ``retriever``, ``topk``, ``max_turns``, ``reward``, ``format_reward``, ...); the prompt templates default to
    the tool-calling ones (:data:`~.environment.TOOL_TEMPLATE`, :data:`~.environment.TOOL_MCQ_TEMPLATE`)."""
    return SearchEnvironmentFactory(env_id, **env_kwargs)


def training_dataset(factory: SearchEnvironmentFactory | Mapping[str, SearchEnvironmentFactory],
                     repeats: int = 1):
    """A ``datasets.Dataset`` with one row per question of ``factory`` (``repeats`` times over): an empty user
    message as ``prompt`` (``reset`` fills it with the question) and the question's ``index``. For a dict of
    factories (TRL's multi-environment mode) every row also names its ``environment``, and the rows of all of
    them are in one dataset (the trainer shuffles it)."""
    import datasets

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    named = dict(factory) if isinstance(factory, Mapping) else {None: factory}
    if not named:
        raise ValueError("training_dataset needs at least one environment factory")
    rows = []
    for name, each in named.items():
        if not isinstance(each, SearchEnvironmentFactory):
            raise TypeError(f"environment {name!r}: expected a search_environment(...) factory, got "
                            f"{type(each).__name__}")
        extra = {} if name is None else {"environment": name}
        rows += [{"prompt": [{"role": "user", "content": ""}], "index": index, **extra}
                 for _ in range(repeats) for index in range(len(each))]
    return datasets.Dataset.from_list(rows)
