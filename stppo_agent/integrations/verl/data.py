"""``stppo export verl``: benchmarks as verl's RL parquet, one file per benchmark (``DIR/<benchmark>_<split>.parquet``).

Each row holds the env's prompt for the example as one user message, the answers in
``reward_model.ground_truth`` (``target`` = golden answers, as Search-R1's data scripts write them, plus the options
and the letter for multiple choice), and in ``extra_info`` what the reward function (:mod:`.reward`) and the agent
loops need to score and rebuild the env: benchmark, ``dataset`` ('' for the bundled demo set), split, index,
``max_turns``, ``reward``, ``format_reward``, ``question_mark``. Every file has one schema, so verl's
``RLHFDataset`` concatenates QA and multiple-choice files.

The prompt follows the row's agent loop (``agent_name``): for ``stppo_env`` it is the env's own (Search-R1's
template: search with ``<search> query </search>``); for ``stppo_tool_agent`` it asks for the search tool in the
tool-call format verl's tool agent parses (hermes ``<tool_call>``), since that loop never reads ``<search>``.

Works without verl (it writes files with ``datasets``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import datasets

from stppo_envs import SearchQAEnv, benchmark_info
from stppo_envs.prompts import SEARCH_R1_MCQ_TEMPLATE, SEARCH_R1_TEMPLATE

ENV_AGENT = "stppo_env"  # this project's env as a verl agent loop (agent_loop.py)
TOOL_AGENT = "stppo_tool_agent"  # verl's tool agent loop with the search tool of tool.py (tool_agent.py)
AGENT_LOOPS = (ENV_AGENT, TOOL_AGENT)

_TOOL_CALL = '<tool_call>{"name": "search", "arguments": {"query_list": ["query"]}}</tool_call>'
_TOOL_SEARCH = (f"you can call the search tool by {_TOOL_CALL.replace('{', '{{').replace('}', '}}')} and it will "
                "return the top searched results between <information> and </information>")  # str.format templates
TOOL_TEMPLATE = SEARCH_R1_TEMPLATE.replace(
    "you can call a search engine by <search> query </search> and it will return the top searched results between "
    "<information> and </information>", _TOOL_SEARCH)
TOOL_MCQ_TEMPLATE = SEARCH_R1_MCQ_TEMPLATE.replace(
    "you can call a search engine by <search> query </search> and it will return the top searched results between "
    "<information> and </information>", _TOOL_SEARCH)
assert "<search>" not in TOOL_TEMPLATE + TOOL_MCQ_TEMPLATE  # Search-R1's wording changed: update the replacement

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
        "format_reward": datasets.Value("float64"), "question_mark": datasets.Value("bool"),
        "need_tools_kwargs": datasets.Value("bool"),
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
    env's settings, recorded per row for the reward function and the agent loops. ``agent_name``: the verl agent
    loop of each row, ``stppo_env`` or ``stppo_tool_agent`` (the prompt follows it).
    """
    if agent_name not in AGENT_LOOPS:
        raise ValueError(f"agent_name must be one of {', '.join(AGENT_LOOPS)} (the loops that play these rows as "
                         f"the env does), got {agent_name!r}")
    if not benchmarks:
        raise ValueError("no benchmark to export: name at least one (e.g. nq,hotpotqa)")
    templates = {"template": TOOL_TEMPLATE, "mcq_template": TOOL_MCQ_TEMPLATE} if agent_name == TOOL_AGENT else {}
    envs = [SearchQAEnv(benchmark_info(name).name, dataset=dataset, split=split, retriever=_NoSearch(),
                        max_turns=max_turns, reward=reward, format_reward=format_reward, limit=limit,
                        question_mark=question_mark, **templates) for name in benchmarks]  # all checked, then written
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for env in envs:
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
                       "reward": env.reward_name, "format_reward": env.format_reward,
                       "question_mark": env.question_mark, "need_tools_kwargs": False},
        "agent_name": agent_name,
    }
