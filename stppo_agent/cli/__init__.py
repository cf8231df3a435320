"""The ``stppo`` command (``python -m stppo_agent.cli`` is the same). Each command's parser and handler live in a
module of their own here; the work they dispatch to lives in the package it belongs to."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

# torch's CPU allocator backs large tensors with transparent huge pages when this is set. torch reads it once, at
# its first allocation, so it is set here, before any command imports torch (none does at import time: tested).
# Measured on `stppo demo` (2-core CPU, THP in madvise mode): 13.5M page faults -> 1.5M, 5:11 -> 4:52 wall, the
# same printed figures. THP_MEM_ALLOC_ENABLE=0 in the environment turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from stppo_agent.cli import compare, demo, evaluate, export, index, plot, replay, serve, sft, train
from stppo_agent.cli.arguments import Parser

COMMANDS = (demo, sft, train, replay, evaluate, index, serve, compare, plot, export)  # in `stppo --help` order


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="stppo", description="The ``stppo`` command (``python -m stppo_agent.cli`` is the same).")
    parser.add_argument("--verbose", action="store_true",
                        help="also show third-party logs and progress bars (Lucene, Anserini, transformers, "
                             "datasets) at their libraries' default levels; without it only their errors show "
                             "(STPPO_VERBOSE=1 does the same)")
    commands = parser.add_subparsers(dest="command")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from stppo_agent.cli.verbosity import set_third_party_output, verbose_requested

    parser = build_parser()
    args = parser.parse_args(argv)
    set_third_party_output(verbose_requested(args.verbose))
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    from stppo_agent.monitoring.collapse_guard import CollapseStopped
    from stppo_agent.runs.checkpoint import CorruptCheckpointError
    from stppo_agent.training.ppo_update import TrainingDivergedError
    from stppo_envs.retrieval import RetrievalError

    try:
        refuse_outputs_inside_checkpoints(args)
        return args.handler(args) or 0
    except CollapseStopped as exc:  # not a failure of the program: its own exit code, so scripts can tell
        print(f"stppo {args.command}: stopped: {exc}", file=sys.stderr)
        return 3
    except (OSError, ValueError, KeyError, RetrievalError, CorruptCheckpointError, TrainingDivergedError,
            ConnectionError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        # one line, however many a library put in its message (transformers' hub errors span several)
        print(f"stppo {args.command}: error: {' '.join(str(message).split())}", file=sys.stderr)
        return 1


def refuse_outputs_inside_checkpoints(args: argparse.Namespace) -> None:
    """No command writes into a run's checkpoints/step-N, whatever its output flag is called."""
    from stppo_agent.runs.run_folder import refuse_inside_checkpoint

    for option in ("output_dir", "out"):
        if getattr(args, option, None):
            refuse_inside_checkpoint(getattr(args, option), "--" + option.replace("_", "-"))
