"""Rows exported for verl as the bridge's tests read them (tests/integrations/verl/): every demo benchmark exported
once, the rows as verl's dataset reads them, the keyword arguments verl's agent loop worker passes per row, and a
retriever that finds one passage for any query. Needs no verl."""

from __future__ import annotations

from pathlib import Path

from stppo_envs import BENCHMARKS
from stppo_envs.retrieval import Hit

PER_BENCHMARK = 4


class OnePassage:
    def search(self, query, k=3):
        return [Hit("7", 1.0, "Title", f"a passage about {query}")][:k]

    def batch_search(self, queries, k=3):
        return [self.search(q, k) for q in queries]


def export_every_benchmark(out: Path) -> list[Path]:
    """The first :data:`PER_BENCHMARK` test examples of every demo benchmark, 3 turns, format reward 0.2."""
    from stppo_agent.integrations.verl.data import export_verl

    return export_verl(list(BENCHMARKS), "test", out, limit=PER_BENCHMARK, max_turns=3, format_reward=0.2)


def parquet_rows(path: Path) -> list[dict]:
    """The rows of an exported parquet file, as verl's RLHFDataset reads them (through ``datasets``)."""
    import datasets

    return list(datasets.load_dataset("parquet", data_files=str(path))["train"])


def row_kwargs(row: dict) -> dict:
    """The keyword arguments verl's AgentLoopWorker passes to an agent loop's ``run`` for a row (its non-tensor
    fields)."""
    return {"extra_info": row["extra_info"], "data_source": row["data_source"], "raw_prompt": row["prompt"],
            "reward_model": row["reward_model"], "agent_name": row["agent_name"], "tools_kwargs": {},
            "index": row["extra_info"]["index"]}
