"""``stppo eval``: an agent evaluated per benchmark, with results files and a verdict on failing searches."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from stppo_agent.cli.arguments import benchmarks_and_datasets, dataset_labels, positive_int, share


def add_parser(commands) -> None:
    from stppo_agent.evaluation.agent_specs import SPEC_HELP
    from stppo_agent.evaluation.agents import DEFAULT_MAX_OBSERVATION_TOKENS
    from stppo_agent.plugins.loader import add_import_argument

    ev = commands.add_parser("eval", help="evaluate an agent per benchmark")
    ev.add_argument("--agent", required=True, help=SPEC_HELP)
    ev.add_argument("--benchmarks", required=True, help="comma-separated, e.g. nq,hotpotqa,medqa")
    ev.add_argument("--dataset", action="append", default=[], metavar="BENCH=PATH",
                    help="data source per benchmark (file, folder or hub name); default: the demo set")
    ev.add_argument("--split", default=None, help="split (default: each benchmark's evaluation split)")
    ev.add_argument("--limit", type=positive_int, default=None, help="first N examples of each benchmark")
    ev.add_argument("--retriever", default=None,
                    help="demo, bm25:DIR, dense:DIR, http://HOST:PORT (default: demo, which only the demo set may "
                         "use implicitly: real data needs its own index or an explicit --retriever demo)")
    ev.add_argument("--topk", type=positive_int, default=3, help="passages per search")
    ev.add_argument("--max-turns", type=positive_int, default=4,
                    help="env steps per episode (Search-R1's max_turns + 1)")
    ev.add_argument("--batch-size", type=positive_int, default=32, help="episodes in flight")
    ev.add_argument("--seed", type=int, default=0, help="sampling seed")
    ev.add_argument("--max-new-tokens", type=positive_int, default=256, help="per turn, for LLM agents")
    ev.add_argument("--max-observation-tokens", type=positive_int, default=None,
                    help=f"tokens of each observation an hf: agent reads, the rest cut (default "
                         f"{DEFAULT_MAX_OBSERVATION_TOKENS}, training's max_observation_tokens); 5 wiki-18 "
                         "passages take ~800 SmolLM2 tokens. hf: agents only (openai: and scripted agents read "
                         "whole observations)")
    ev.add_argument("--max-search-error-rate", type=share, default=0.01,
                    help="exit non-zero (results still written, flagged) when more than this share of searches "
                         "failed on any benchmark: its scores measure a broken retriever (default 0.01)")
    ev.add_argument("--output-dir", required=True, help="results.json, results.csv, episodes.jsonl")
    ev.add_argument("--overwrite", action="store_true",
                    help="replace another agent's results in --output-dir (a run's own checkpoints replace theirs "
                         "without it)")
    add_import_argument(ev)
    ev.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from stppo_agent.evaluation.results import check_results_folder, evaluate_all, format_table, write_results
    from stppo_agent.plugins.loader import load_plugins
    from stppo_agent.plugins.name_checks import check_retriever
    from stppo_agent.rollouts.envs import refuse_real_data_without_retriever

    load_plugins(args.imports)  # agents of your own (register_agent)
    if args.retriever is not None:
        check_retriever(args.retriever)
    benchmarks, datasets = benchmarks_and_datasets(args.benchmarks, args.dataset)
    refuse_real_data_without_retriever(dataset_labels(datasets), args.retriever)
    retriever = args.retriever or "demo"
    check_results_folder(Path(args.output_dir), args.agent, args.overwrite)  # before minutes of episodes
    results = evaluate_all(args.agent, benchmarks, datasets, args.split, args.limit, retriever, args.topk,
                           args.max_turns, args.batch_size, args.seed, args.max_new_tokens, args.max_observation_tokens)
    write_results(results, Path(args.output_dir))
    print(format_table(results))
    warn_of_cut_observations(results)
    return search_error_verdict(results, args.max_search_error_rate)


def warn_of_cut_observations(results: Sequence[dict[str, Any]]) -> None:
    """Say on stderr where an hf: agent's observations were cut: it read fewer passages than ``--topk`` says."""
    from stppo_agent.evaluation.agents import DEFAULT_MAX_OBSERVATION_TOKENS  # provenance omits the default

    cut = {r["benchmark"]: (r["metrics"]["observation_cut_rate"],
                            r["provenance"].get("max_observation_tokens", DEFAULT_MAX_OBSERVATION_TOKENS))
           for r in results if r["metrics"].get("observation_cut_rate", 0.0) > 0}
    if cut:
        detail = ", ".join(f"{name} {rate:.1%} at {limit} tokens" for name, (rate, limit) in cut.items())
        print(f"stppo eval: warning: observations were cut ({detail}; share of those the agent read), as in "
              "training (max_observation_tokens): the agent did not see every passage --topk asked for; "
              "--max-observation-tokens raises the limit.",
              file=sys.stderr)


def search_error_verdict(results: Sequence[dict[str, Any]], limit: float) -> int:
    """1 (and a message naming the benchmarks) when a benchmark's searches failed more often than ``limit``."""
    failing = {r["benchmark"]: r["metrics"].get("search_error_rate", 0.0) for r in results
               if r["metrics"].get("search_error_rate", 0.0) > limit}
    if not failing:
        return 0
    detail = ", ".join(f"{name} {rate:.1%}" for name, rate in failing.items())
    print(f"stppo eval: error: searches failed ({detail}; limit {limit:.1%}): these scores measure a failing "
          "retriever, not the agent. Check the retriever (a server that is down?) and rerun; "
          "--max-search-error-rate raises the limit.", file=sys.stderr)
    return 1
