"""``stppo plot``: training curves of runs as PNG files."""

from __future__ import annotations

import argparse


def add_parser(commands) -> None:
    plot = commands.add_parser("plot", help="training curves of one or more runs as PNG files")
    plot.add_argument("runs", nargs="+", help="run folders (with metrics.jsonl)")
    plot.add_argument("--out", required=True, help="folder for the PNG files")
    plot.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from stppo_agent.runs.plots import plot_runs

    for path in plot_runs(args.runs, args.out):
        print(path)
    return 0
