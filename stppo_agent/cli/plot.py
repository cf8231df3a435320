"""``stppo plot``: training curves of runs as PNG files."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands) -> None:
    plot = commands.add_parser("plot", help="training curves of one or more runs as PNG files")
    plot.add_argument("runs", nargs="+", help="run folders (with metrics.jsonl)")
    plot.add_argument("--out", required=True, help="folder for the PNG files")
    plot.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from stppo_agent.runs.plots import plot_runs

    for folder in args.runs:
        check_run_folder(Path(folder))
    for path in plot_runs(args.runs, args.out):
        print(path)
    return 0


def check_run_folder(folder: Path) -> None:
    """Every run named must be a folder with metrics: a mistyped one would otherwise be left out of the plots
    silently."""
    from stppo_agent.evaluation.agent_specs import folder_listing, missing_folder

    if not folder.exists():
        raise FileNotFoundError(missing_folder(folder))
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file, not a run folder")
    if not (folder / "metrics.jsonl").is_file():
        contents = f"it holds: {folder_listing(folder)}" if any(folder.iterdir()) else "it is empty"
        raise FileNotFoundError(f"{folder} holds no metrics.jsonl, so no curves ({contents}); a training run writes "
                                "it as its iterations end")
