"""``stppo export verl``: benchmarks as verl's RL parquet, one file per benchmark (``DIR/<benchmark>_<split>.parquet``).

Each row holds the env's own prompt for the example (Search-R1's template, ``?`` added as the env adds it) as one
user message, the answers in ``reward_model.ground_truth`` (``target`` = golden answers, as Search-R1's data
scripts write them, plus the options and the letter for multiple choice), and in ``extra_info`` what the reward
function (:mod:`.reward`) and the ``stppo_env`` agent loop (:mod:`.agent_loop`) need to score and rebuild the env:
benchmark, ``dataset`` ('' for the bundled demo set), split, index, ``max_turns``, ``reward``, ``format_reward``.
Every file has one schema, so verl's ``RLHFDataset`` concatenates QA and multiple-choice files.

Works without verl (it writes files with ``datasets``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import datasets

from stppo_envs import SearchQAEnv, benchmark_info

ENV_AGENT = "stppo_env"  # this project's env as a verl agent loop (agent_loop.py)
TOOL_AGENT = "tool_agent"  # verl's own tool agent loop, with the search tool of tool.py (examples/verl/)

_STRING_LIST = datasets.Sequence(datasets.Value("string"))
FEATURES = datasets.Features({
    "data_source": datasets.Value("string"),
    "prompt": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
    "ability": datasets.Value("string"),
    "reward_model": {
        "style": datasets.Value("string"),
        "ground_truth": {"target": _STRING_LIST, "choices": [{"letter": datasets.Value("string"),
                                                               "text": datasets.Value("string")}],
                         "answer_letter": datasets.Value("string")},
    },
    "extra_info": {
        "split": datasets.Value("string"), "index": datasets.Value("int64"), "example_id": datasets.Value("string"),
        "benchmark": datasets.Value("string"), "question": datasets.Value("string"),
        "dataset": datasets.Value("string"),
        "max_turns": datasets.Value("int64"), "reward": datasets.Value("string"),
        "format_reward": datasets.Value("float64"), "need_tools_kwargs": datasets.Value("bool"),
    },
    "agent_name": datasets.Value("string"),
})


class _NoSearch:
    """The export never searches; the env only needs a retriever object to exist."""

    def search(self, query, k=10):
        raise RuntimeError("export does not search")

    batch_search = search


def export_verl(benchmarks: Sequence[str], split: str, out: str | Path, *, dataset: str | None = None,
                limit: int | None = None, max_turns: int = 4, reward: str = "auto", format_reward: float = 0.0,
                question_mark: bool = True, agent_name: str = ENV_AGENT) -> list[Path]:
    """Write ``out/<benchmark>_<split>.parquet`` for each benchmark; returns the paths written.

    ``dataset`` is the env's ``dataset`` argument for every benchmark (None: the bundled demo set; ``"hub"``: each
    benchmark's standard hub dataset). ``max_turns``, ``reward``, ``format_reward`` and ``question_mark`` are the
    env's settings, recorded per row for the reward function. ``agent_name``: the verl agent loop of each row.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in benchmarks:
        env = SearchQAEnv(benchmark_info(name).name, dataset=dataset, split=split, retriever=_NoSearch(),
                          max_turns=max_turns, reward=reward, format_reward=format_reward, limit=limit,
                          question_mark=question_mark)
        rows = [_row(env, index, example, split, agent_name) for index, example in enumerate(env.examples)]
        path = out / f"{env.benchmark}_{split}.parquet"
        datasets.Dataset.from_list(rows, features=FEATURES).to_parquet(str(path))
        written.append(path)
    return written


def _portable(dataset) -> str:
    """The dataset as a worker on another machine must name it: a local path made absolute, '' for the demo set."""
    if not dataset:
        return ""
    path = Path(dataset).expanduser()
    return str(path.resolve()) if path.exists() else str(dataset)


def _row(env: SearchQAEnv, index: int, example, split: str, agent_name: str) -> dict:
    mcq = example.is_multiple_choice
    return {
        "data_source": env.benchmark,
        "prompt": [{"role": "user", "content": env.prompt_for(example)}],
        "ability": "search-mcq" if mcq else "search-qa",
        "reward_model": {"style": "rule", "ground_truth": {
            "target": list(example.golden_answers),
            "choices": [{"letter": k, "text": v} for k, v in (example.choices or {}).items()],
            "answer_letter": example.answer_letter or "",
        }},
        "extra_info": {"split": split, "index": index, "example_id": example.id, "benchmark": env.benchmark,
                       "question": example.question, "dataset": _portable(env.dataset), "max_turns": env.max_turns,
                       "reward": env.reward_name, "format_reward": env.format_reward, "need_tools_kwargs": False},
        "agent_name": agent_name,
    }
