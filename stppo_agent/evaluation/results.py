"""Evaluating an agent on several benchmarks and what comes of it: results.json / results.csv / episodes.jsonl and
the fixed-width table the commands print."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Sequence

from stppo_agent.evaluation.tables import fixed_width_table


def evaluate_all(agent: str, benchmarks: Sequence[str], datasets: dict[str, str], split, limit, retriever,
                 topk, max_turns, batch_size, seed, max_new_tokens: int = 256,
                 max_observation_tokens: int | None = None) -> list[dict[str, Any]]:
    from stppo_agent.evaluation.agent_specs import resolve_agent_spec
    from stppo_agent.evaluation.evaluate import EvalSettings, evaluate_benchmark
    from stppo_envs import benchmark_info

    names = [benchmark_info(b).name for b in benchmarks]  # fail fast on unknown names, before any work
    agent, chosen = resolve_agent_spec(agent)
    if chosen:
        print(f"agent {chosen}")
    return [evaluate_benchmark(agent, EvalSettings(name, datasets.get(name), split, limit, retriever, topk,
                                                   max_turns, batch_size, seed, max_new_tokens, max_observation_tokens))
            for name in names]


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table, one row per benchmark, plus the QA-family average as in Search-R1's tables."""
    with_tokens = any("mean_response_tokens" in r["metrics"] for r in results)  # LLM agents only
    with_errors = any(r["metrics"].get("search_error_rate", 0.0) > 0 for r in results)
    with_cuts = any(r["metrics"].get("observation_cut_rate", 0.0) > 0 for r in results)
    header = ["benchmark", "n", "EM/acc", "F1", "answer", "invalid", "turns", "searches"] + ["tokens"] * with_tokens \
        + ["search errors"] * with_errors + ["obs cut"] * with_cuts
    rows = []
    for result in results:
        m = result["metrics"]
        rows.append([result["benchmark"], str(m["n"]), f"{m.get('em', m.get('acc', 0.0)):.3f}",
                     f"{m['f1']:.3f}" if "f1" in m else "-", f"{m['answer_rate']:.3f}",
                     f"{m['invalid_action_rate']:.3f}", f"{m['mean_turns']:.2f}", f"{m['mean_search_calls']:.2f}"]
                    + [f"{m.get('mean_response_tokens', 0.0):.1f}"] * with_tokens
                    + [f"{m.get('search_error_rate', 0.0):.3f}"] * with_errors
                    + [f"{m.get('observation_cut_rate', 0.0):.3f}"] * with_cuts)
    qa = [r["metrics"]["em"] for r in results if "em" in r["metrics"]]
    if len(qa) > 1:
        rows.append(["QA avg (EM)", "", f"{sum(qa) / len(qa):.3f}"] + [""] * (len(header) - 3))
    return fixed_width_table(header, rows)


# put in place in this order: results.json, which `stppo compare` reads, last
RESULT_FILES = ("episodes.jsonl", "results.csv", "results.json")


def check_writable(path: Path, option: str = "--output-dir", beside: bool = False) -> None:
    """Refuse, before any work, a ``path`` that cannot become a folder with files in it (a file in the way, a
    read-only parent): found only at the end, it would cost the whole evaluation or fine-tune. ``beside``: the
    folder is written next to ``path`` and renamed into its place, so it is ``path``'s parent that must take it."""
    path = Path(path).expanduser()
    existing = path
    if beside:  # "." and ".." name no folder to be beside; their parent is found from the absolute path
        existing = path.parent if path.name not in ("", "..") else Path(os.path.abspath(path)).parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(f"{option} {path} cannot be a folder: {existing} is a file; choose another {option}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"{option} {path} cannot be written: {existing} is not writable by this user; choose "
                              f"another {option}")


def check_results_folder(out: Path, agent: str, overwrite: bool = False) -> None:
    """``stppo eval``'s ``--output-dir``, checked before the evaluation: writable, and not holding another agent's
    results (they would be replaced silently) unless ``overwrite``. A training run's checkpoints count as one agent,
    so a run evaluated again as it trains replaces its own results."""
    from stppo_agent.evaluation.agent_specs import agent_identity
    from stppo_agent.evaluation.comparison import load_results

    check_writable(out)
    previous = Path(out) / "results.json"
    if overwrite or not previous.exists():
        return
    try:
        records = load_results(previous)
    except ValueError as exc:
        raise FileExistsError(f"{exc}; pass --overwrite to replace it, or choose another --output-dir") from None
    recorded = sorted({str((r.get("provenance") or {}).get("agent", "an unnamed agent")) for r in records})
    others = [name for name in recorded if agent_identity(name) != agent_identity(agent)]
    if others:
        benchmarks = ", ".join(r["benchmark"] for r in records)
        raise FileExistsError(f"{out} holds the results of another agent ({others[0]} on {benchmarks}); this "
                              f"evaluation is of {agent}: choose another --output-dir, or pass --overwrite to replace "
                              "them")


def write_results(results: Sequence[dict[str, Any]], out: Path) -> None:
    """results.json, results.csv and episodes.jsonl in ``out``: each written whole beside its old version, then
    the three put in place, so a failure (a full disk, a kill) part-way leaves the previous results whole."""
    out.mkdir(parents=True, exist_ok=True)
    summary = [{k: v for k, v in r.items() if k != "episodes"} for r in results]
    staged = {name: out / f".{name}.partial-{os.getpid()}" for name in RESULT_FILES}
    try:
        with open(staged["episodes.jsonl"], "w", encoding="utf-8") as handle:
            for result in results:
                for episode in result["episodes"]:
                    handle.write(json.dumps({"benchmark": result["benchmark"], **episode}, sort_keys=True) + "\n")
        metric_names = sorted({k for r in results for k in r["metrics"]})
        with open(staged["results.csv"], "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["benchmark", *metric_names])
            for r in results:
                writer.writerow([r["benchmark"], *(r["metrics"].get(k, "") for k in metric_names)])
        staged["results.json"].write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    except BaseException:
        for path in staged.values():
            path.unlink(missing_ok=True)
        raise
    for name in RESULT_FILES:
        os.replace(staged[name], out / name)
