"""``stppo replay``: an algorithm's updates applied to a run's recorded rollouts."""

from __future__ import annotations

import argparse
import json


def add_parser(commands) -> None:
    from stppo_agent.plugins.loader import add_import_argument

    rep = commands.add_parser("replay", help="apply an algorithm's updates to a run's recorded rollouts "
                                              "(train it with --set logging.save_rollouts=true)")
    rep.add_argument("run", help="run folder with rollouts/ (recorded with --set logging.save_rollouts=true)")
    rep.add_argument("--algo", default=None, help="algorithm to replay with (default: the recorded run's own)")
    rep.add_argument("--output-dir", required=True, help="the replay's run folder")
    rep.add_argument("--resume", action="store_true",
                     help="continue an interrupted replay in --output-dir from its last valid checkpoint")
    rep.add_argument("--overwrite", action="store_true", help="replace the run the output folder holds")
    rep.add_argument("--iterations", type=int, default=None, help="replay the first N recorded iterations")
    rep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a field of the recorded config, e.g. algorithm.clip_high=0.28")
    add_import_argument(rep, recorded=True)
    rep.add_argument("--json", action="store_true",
                     help="end with the last iteration's metrics as JSON instead of the summary (for scripts)")
    rep.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from stppo_agent.cli.train import check_run_settings, print_outcome
    from stppo_agent.distributed import process_group
    from stppo_agent.plugins.loader import load_plugins, portable_specs
    from stppo_agent.plugins.name_checks import check_algorithm
    from stppo_agent.training.config import load_config
    from stppo_agent.training.replay import recorded_config, replay

    overrides = list(args.overrides)
    check_run_settings(load_config(None,
                                   overrides))  # a typo in --set monitor.on_collapse=... answers before any loading
    if args.imports:  # added to the recorded run's plugins (which the replay imports again); an explicit --set wins
        merged = portable_specs([*recorded_config(args.run).plugins, *args.imports])
        overrides.insert(0, f"plugins={json.dumps(merged)}")
        load_plugins(merged)
    if args.algo is not None:
        load_plugins(recorded_config(args.run).plugins)
        check_algorithm(args.algo)
    with process_group.process_group_for_command():
        metrics = replay(args.run, args.algo, args.output_dir, overrides, args.iterations, resume=args.resume,
                         overwrite=args.overwrite)
        main = process_group.is_main()
    if main:
        print_outcome(args, metrics, args.output_dir, f"replay of {args.run} written to")
    return 0
