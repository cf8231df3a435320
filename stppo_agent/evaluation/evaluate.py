"""Per-benchmark evaluation of any agent, with results that describe how they were produced.

Every example of the requested split is run exactly once, in file order (no shuffling, no dropping), in
batches whose searches go to the retriever as one ``batch_search`` call. A result record carries its
provenance (dataset content hash, retriever, top-k, prompt-template hash, max turns, agent, seed, version) so
two records can be compared only when they measure the same thing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time
from typing import Any, Sequence

import stppo_envs
from stppo_agent.evaluation.agents import DEFAULT_MAX_OBSERVATION_TOKENS, Agent, EpisodeView, observation_budget
from stppo_agent.evaluation.comparison import searched_index_id
from stppo_agent.rollouts.episode_stats import episode_rates
from stppo_envs import SearchQAEnv
from stppo_envs.prompts import template_hash
from stppo_envs.retrieval import make_retriever
from stppo_envs.retrieval.base import portable_name
from stppo_envs.scoring import SCORING_VERSION
from stppo_envs.vector import serve_searches


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """One benchmark evaluation: which data, which search tool, which episode limits."""

    benchmark: str
    dataset: str | None = None  # None: the bundled demo set
    split: str | None = None
    limit: int | None = None
    retriever: str = "demo"
    topk: int = 3
    max_turns: int = 4
    batch_size: int = 32
    seed: int = 0
    max_new_tokens: int = 256  # per turn, for LLM agents
    max_observation_tokens: int | None = None  # per observation, hf: agents only (None: training's default)


def run_episodes(envs: Sequence[SearchQAEnv], agent: Agent, indices: Sequence[int], seed: int = 0) -> list[dict]:
    """Run one episode per example index with ``len(envs)`` episodes in flight; return one record each."""
    from tqdm.auto import tqdm

    records: list[dict] = []
    retriever, topk = envs[0].retriever, envs[0].topk
    episode_ids = _episode_ids([envs[0].examples[i].id for i in indices])
    # episodes/s and ETA on a terminal (an LLM agent on a CPU takes minutes); silent in logs and CI
    bar = tqdm(total=len(indices), desc=envs[0].benchmark, unit="episode", disable=None, leave=False)
    for start in range(0, len(indices), len(envs)):
        chunk = indices[start:start + len(envs)]
        chunk_episode_ids = episode_ids[start:start + len(envs)]
        active = {slot: envs[slot] for slot in range(len(chunk))}
        for slot, env in active.items():
            env.reset(seed=seed + chunk[slot], options={"index": chunk[slot]})
        chunk_records: dict[int, dict] = {}
        while active:
            slots = list(active)
            actions = agent.act([_view(active[s], chunk_episode_ids[s]) for s in slots])
            if len(actions) != len(slots):  # zip would pair what it could: lost actions, episodes asked forever
                raise ValueError(f"agent {getattr(agent, 'name', type(agent).__name__)} returned {len(actions)} "
                                 f"actions for {len(slots)} episodes")
            parsed = {s: active[s].begin_step(a) for s, a in zip(slots, actions)}
            hits, errors = serve_searches(retriever, topk,
                                          {s: p for s, p in parsed.items() if active[s].needs_search(p)})
            for slot, action in zip(slots, actions):
                env = active[slot]
                _, reward, terminated, truncated, info = env.finish_step(action, parsed[slot], hits.get(slot),
                                                                         errors.get(slot))
                if terminated or truncated:
                    chunk_records[slot] = _episode_record(env, reward, terminated, truncated, info)
                    chunk_records[slot]["episode_id"] = chunk_episode_ids[slot]
                    if hasattr(agent, "generated_tokens"):  # LLM agents count their tokens; scripted ones have none
                        chunk_records[slot]["response_tokens"] = agent.generated_tokens(chunk_episode_ids[slot])
                    if hasattr(agent, "observations_cut"):  # agents that cut observations to a token budget
                        chunk_records[slot]["observations_cut"] = agent.observations_cut(chunk_episode_ids[slot])
                    del active[slot]
                    bar.update(1)
        records += [chunk_records[slot] for slot in range(len(chunk))]
    bar.close()
    return records


def _episode_ids(example_ids: Sequence[str]) -> list[str]:
    """One id per episode, unique within the run: the example id, then ``<id>#2``, ``<id>#3``, ... for further
    episodes of the same example (agents key per-episode state by it, never by the example id)."""
    ids: list[str] = []
    used: set[str] = set()
    for example_id in example_ids:
        candidate, n = example_id, 1
        while candidate in used:  # also past an example whose own id looks like "<id>#2"
            n += 1
            candidate = f"{example_id}#{n}"
        used.add(candidate)
        ids.append(candidate)
    return ids


def _view(env: SearchQAEnv, episode_id: str) -> EpisodeView:
    example = env.example
    return EpisodeView(example.id, example.question, example.choices, tuple(env.transcript), env.turn,
                       env.max_turns, episode_id)


def _episode_record(env: SearchQAEnv, reward: float, terminated: bool, truncated: bool, info: dict) -> dict:
    record = {
        "example_id": env.example.id, "reward": reward, "terminated": bool(terminated), "truncated": bool(truncated),
        "question": env.example.question, "golden_answers": list(env.example.golden_answers),
        "prediction": info["prediction"], "turns": info["turn"], "search_calls": info["search_calls"],
        "invalid_actions": info["invalid_actions"], "search_errors": info["search_errors"],
        "response_chars": sum(len(s.text) for s in env.transcript if s.role == "assistant"),
        # the whole episode, so it can be read back (and used as a demonstration by `stppo sft`)
        "transcript": [{"role": s.role, "text": s.text, "turn": s.turn} for s in env.transcript],
    }
    for key in ("em", "f1", "correct"):
        if key in info:
            record[key] = info[key]
    return record


def summarize(records: Sequence[dict], multiple_choice: bool) -> dict[str, float]:
    """Benchmark-level metrics from episode records."""
    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in records) if records else 0.0

    metrics = {"n": len(records)}
    if multiple_choice:
        metrics["acc"] = mean("correct")
    else:
        metrics["em"] = mean("em")
        metrics["f1"] = mean("f1")
    metrics.update(episode_rates([{**r, "answered": r["terminated"]} for r in records]))
    metrics.update({
        "mean_turns": mean("turns"),
        "mean_search_calls": mean("search_calls"),
        "mean_response_chars": mean("response_chars"),
    })
    if records and all("response_tokens" in r for r in records):
        metrics["mean_response_tokens"] = mean("response_tokens")
    if records and all("observations_cut" in r for r in records):
        # of the observations the agent read: every turn's but the last (that episode's end)
        read = sum(r["turns"] - 1 for r in records)
        metrics["observation_cut_rate"] = sum(r["observations_cut"] for r in records) / max(1, read)
    return metrics


def evaluate_benchmark(agent_spec: str, settings: EvalSettings, agent_factory=None) -> dict[str, Any]:
    """Evaluate one agent on one benchmark; returns a self-describing result record."""
    from stppo_agent.evaluation.agent_specs import build_agent

    retriever = make_retriever(settings.retriever)
    envs = [SearchQAEnv(settings.benchmark, settings.dataset, settings.split, retriever=retriever,
                        topk=settings.topk, max_turns=settings.max_turns, limit=settings.limit)
            for _ in range(max(1, settings.batch_size))]
    examples = envs[0].examples
    envs = envs[: min(len(envs), len(examples))]
    if agent_factory is None:
        agent = build_agent(agent_spec, examples, settings.max_new_tokens, settings.max_observation_tokens)
    else:
        agent = agent_factory(agent_spec, examples, settings.max_new_tokens)
    started = time.time()
    records = run_episodes(envs, agent, list(range(len(examples))), seed=settings.seed)
    multiple_choice = examples[0].is_multiple_choice
    return {
        "benchmark": settings.benchmark,
        "metrics": summarize(records, multiple_choice),
        "provenance": provenance(agent_spec, settings, envs[0], observation_cut(agent, settings)),
        "episodes": records,
        "timing": {"started": started, "seconds": time.time() - started},
    }


def observation_cut(agent: Agent, settings: EvalSettings) -> int | None:
    """Tokens of each observation the agent read: what it says (``None``: whole observations), else the setting."""
    if hasattr(agent, "max_observation_tokens"):
        return agent.max_observation_tokens
    return observation_budget(settings.max_observation_tokens)


def provenance(agent_spec: str, settings: EvalSettings, env: SearchQAEnv, cut: int | None) -> dict[str, Any]:
    """Everything that must match for two results to be comparable; ``cut``: :func:`observation_cut`."""
    recorded = {
        "agent": agent_spec,
        "benchmark": settings.benchmark,
        "dataset": portable_name(settings.dataset) if settings.dataset else "demo",
        "split": settings.split or stppo_envs.benchmark_info(settings.benchmark).default_split,
        "dataset_sha256": examples_hash(env.examples),
        "limit": settings.limit,
        "retriever": portable_spec(settings.retriever),
        "retriever_id": searched_index_id(getattr(env.retriever, "index_id", repr(env.retriever))),
        "topk": settings.topk,
        "max_turns": settings.max_turns,
        "prompt_template": template_hash(env.template, env.mcq_template, "question_mark" * env.question_mark),
        "seed": settings.seed,
        "max_new_tokens": settings.max_new_tokens,
        "stppo_version": stppo_envs.__version__,
        "scoring_version": SCORING_VERSION,
    }
    if cut != DEFAULT_MAX_OBSERVATION_TOKENS:
        recorded["max_observation_tokens"] = cut
    return recorded


def portable_spec(spec) -> str:
    """A retriever spec without the machine's directories (``bm25:/data/idx/wiki`` -> ``bm25:wiki``): results
    identify the index by ``retriever_id`` (its content), and must not depend on where it lives."""
    if not isinstance(spec, str):
        return type(spec).__name__
    kind, sep, location = spec.partition(":")
    if sep and kind in ("bm25", "dense") and location:
        return f"{kind}:{portable_name(location)}"
    return spec


def examples_hash(examples: Sequence[stppo_envs.Example]) -> str:
    """SHA-256 of the examples' canonical JSON: the same questions and answers give the same hash."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(json.dumps(example.to_dict(), sort_keys=True, ensure_ascii=False).encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()
