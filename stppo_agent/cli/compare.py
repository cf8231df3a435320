"""``stppo compare``: evaluation results side by side, refusing mismatched provenance."""

from __future__ import annotations

import argparse


def add_parser(commands) -> None:
    cmp = commands.add_parser("compare", help="compare evaluation results; refuses mismatched provenance")
    cmp.add_argument("results", nargs="+", help="results.json files or evaluation folders")
    cmp.add_argument("--force", action="store_true", help="print mismatched results anyway, flagged")
    cmp.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from stppo_agent.evaluation.comparison import compare, load_results
    from stppo_agent.runs.labels import distinct_labels

    print(compare([load_results(path) for path in args.results], distinct_labels(args.results), args.force))
    return 0
