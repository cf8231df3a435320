"""Evaluating an agent on several benchmarks and what comes of it: results.json / results.csv / episodes.jsonl and
the fixed-width table the commands print."""

from __future__ import annotations

import csv
import json
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


def write_results(results: Sequence[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = [{k: v for k, v in r.items() if k != "episodes"} for r in results]
    (out / "results.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    with open(out / "episodes.jsonl", "w", encoding="utf-8") as handle:
        for result in results:
            for episode in result["episodes"]:
                handle.write(json.dumps({"benchmark": result["benchmark"], **episode}, sort_keys=True) + "\n")
    metric_names = sorted({k for r in results for k in r["metrics"]})
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["benchmark", *metric_names])
        for r in results:
            writer.writerow([r["benchmark"], *(r["metrics"].get(k, "") for k in metric_names)])
