"""Comparing evaluation records (refusing apples to oranges)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from stppo_agent.evaluation.agents import BASELINE_AGENTS, DEFAULT_MAX_OBSERVATION_TOKENS
from stppo_agent.evaluation.tables import fixed_width_table

# Provenance fields that may differ between records that are still comparable: they identify the contestant,
# or only say where the data and index lived and how the index was reached (their content is compared through
# dataset_sha256 and retriever_id: the same index under two paths, or local and served, compares; a rebuilt index
# at the same path does not).
CONTESTANT_FIELDS = ("agent", "dataset", "retriever")

# An LLM's limits: a built-in scripted baseline neither generates nor tokenises, so its score does not depend on
# them and it compares with a model evaluated under any of them.
LLM_FIELDS = ("max_new_tokens", "max_observation_tokens")

# How the examples were chosen: records whose examples are the same (equal dataset_sha256) compare whatever these
# say (a --limit at or above the dataset's size, a split alias that reads the same rows); where the hashes differ
# or one is missing, they are compared like any other field (and say why the examples differ).
SELECTION_FIELDS = ("split", "limit")

# What a field's absence means: records omit the observation cut at its default (the only value before the
# setting existed); ``null`` is an agent that read whole observations (openai:).
ABSENT_MEANS = {"max_observation_tokens": DEFAULT_MAX_OBSERVATION_TOKENS}


def searched_index_id(index_id: str) -> str:
    """What a retriever searches, not how it is reached: a ``stppo serve`` client's id is ``remote:`` + the served
    index's own id (from /health), which names the same index as a local run of it; a server that does not say
    what it serves stays ``remote:URL``, known by its address only (never equal to a local index).

    >>> searched_index_id("remote:bm25:corpus-sha256:ab12"), searched_index_id("remote:http://h:8000/retrieve")
    ('bm25:corpus-sha256:ab12', 'remote:http://h:8000/retrieve')
    """
    while index_id.startswith("remote:") and not index_id.removeprefix("remote:").startswith(("http://", "https://")):
        index_id = index_id.removeprefix("remote:")  # a server in front of a server: still the same index
    return index_id


def _comparable(key: str, value: Any) -> Any:
    return searched_index_id(value) if key == "retriever_id" and isinstance(value, str) else value


class ProvenanceMismatchError(ValueError):
    """Two results were produced under different conditions (data, retriever, prompt, limits, ...)."""


def load_results(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.exists():
        raise FileNotFoundError(f"no results.json at {path}; produce one with `stppo eval ... --output-dir DIR`")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a readable results.json ({exc})") from exc
    if not isinstance(results, list) or not all(isinstance(r, dict) and {"benchmark", "metrics"} <= set(r)
                                                for r in results):
        raise ValueError(f"{path} is not a results.json of `stppo eval` (a list of benchmark records)")
    return results


def provenance_differences(records: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Fields (other than the contestant's identity) whose values differ across records of one benchmark."""
    ignored = set(CONTESTANT_FIELDS)
    hashes = [r["provenance"].get("dataset_sha256") for r in records]
    if hashes and hashes[0] is not None and all(h == hashes[0] for h in hashes):
        ignored |= set(SELECTION_FIELDS)
    keys = sorted(({k for r in records for k in r["provenance"]} | set(ABSENT_MEANS)) - ignored)
    differences = {}
    for key in keys:
        values = [_comparable(key, r["provenance"].get(key, ABSENT_MEANS.get(key))) for r in records]
        bearing = [v for v, r in zip(values, records)
                   if not (key in LLM_FIELDS and r["provenance"].get("agent") in BASELINE_AGENTS)]
        if any(v != bearing[0] for v in bearing):
            differences[key] = values
    return differences


SEARCH_ERROR_TOLERANCE = 0.005
"""Search-error rates further apart than this make results incomparable: the scores then differ by retriever
failures, not by agents."""


def search_error_differences(records: Sequence[dict[str, Any]]) -> list[float] | None:
    rates = [float(r["metrics"].get("search_error_rate", 0.0)) for r in records]
    return rates if rates and max(rates) - min(rates) > SEARCH_ERROR_TOLERANCE else None


COMPARED_METRICS = (("em", "EM"), ("acc", "acc"), ("f1", "F1"), ("answer_rate", "answer rate"),
                    ("invalid_action_rate", "invalid rate"), ("search_error_rate", "search errors"),
                    ("mean_turns", "turns"), ("mean_search_calls", "searches"), ("n", "n"))


def compare(result_sets: Sequence[Sequence[dict[str, Any]]], labels: Sequence[str], force: bool = False) -> str:
    """Every metric per benchmark, one column per result set; mismatched provenance raises unless ``force``."""
    benchmarks = sorted({r["benchmark"] for results in result_sets for r in results})
    warnings = []
    header = ["benchmark", "metric", *labels]
    rows = []
    for benchmark in benchmarks:
        records = [next((r for r in results if r["benchmark"] == benchmark), None) for results in result_sets]
        present = [r for r in records if r is not None]
        differences = provenance_differences(present)
        error_rates = search_error_differences(present)
        if error_rates:
            differences["search_error_rate"] = [round(rate, 4) for rate in error_rates]
        if differences:
            detail = "; ".join(f"{k}: {v}" for k, v in differences.items())
            if not force:
                raise ProvenanceMismatchError(
                    f"{benchmark}: results are not comparable ({detail}); rerun under the same settings or pass "
                    "--force to print them flagged")
            warnings.append(f"!! {benchmark} NOT COMPARABLE: {detail}")
        name = benchmark + (" (!)" if differences else "")
        for key, title in COMPARED_METRICS:
            if not any(r is not None and key in r["metrics"] for r in records):
                continue
            cells = ["-" if r is None or key not in r["metrics"] else
                     (str(r["metrics"][key]) if key == "n" else f"{r['metrics'][key]:.3f}") for r in records]
            rows.append([name, title, *cells])
            name = ""
    return "\n".join([fixed_width_table(header, rows), *warnings])
