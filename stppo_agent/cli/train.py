"""``stppo train``: train a policy with a PPO-family algorithm (``torchrun ... -m stppo_agent.cli train`` for
several processes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stppo_agent.cli.arguments import positive_int


def add_parser(commands) -> None:
    from stppo_agent.plugins.loader import add_import_argument

    train = commands.add_parser("train", help="train a policy with a PPO-family algorithm", add_help=False)
    train.add_argument("-h", "--help", dest="show_help", action="store_true",
                       help="show this help, every setting --set takes with its default, and with --algo NAME the "
                            "settings that algorithm's rules read")
    from stppo_agent.algorithms import ALGORITHMS

    train.add_argument("--algo", default=None,
                       help=f"algorithm preset: {', '.join(sorted(ALGORITHMS))}, or one a plugin registers")
    train.add_argument("--env", default=None, help="comma-separated env ids, e.g. stppo/NQ-v0,stppo/HotpotQA-v0")
    train.add_argument("--model", default=None, help="Hugging Face folder or hub name; 'smollm2' for the default "
                                                      "model, 'tiny' for a random Llama that learns stppo/Toy-v0")
    train.add_argument("--output-dir", default=None, help="run folder")
    train.add_argument("--iterations", type=positive_int, default=None,
                       help="iterations (default: the config's, else 100)")
    train.add_argument("--config", default=None, help="YAML file of settings (top-level keys and sections, as "
                                                       "config.yaml holds them)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a setting: optimizer.actor_lr=1e-6, rollout.samples_per_prompt=8, "
                            "algorithm.clip_high=0.28, env_kwargs.retriever=bm25:DIR (the keys: --help)")
    add_import_argument(train, recorded=True)
    train.add_argument("--resume", action="store_true",
                       help="continue from the run folder's last valid checkpoint, with the run's own config.yaml "
                            "unless --config is given")
    train.add_argument("--overwrite", action="store_true", help="replace the run the output folder holds")
    train.add_argument("--json", action="store_true",
                       help="end with the last iteration's metrics as JSON instead of the summary (for scripts)")
    train.set_defaults(handler=run, parser=train)


def run(args: argparse.Namespace) -> int:
    from stppo_agent.distributed import process_group

    if args.show_help:
        from stppo_agent.cli.settings_help import settings_help

        print(args.parser.format_help() + "\n" + settings_help(args.algo, args.imports))
        raise SystemExit(0)

    with process_group.process_group_for_command():  # under torchrun: gloo on CPU, NCCL on GPUs
        (metrics, run_dir), main = _train(args), process_group.is_main()
    if main:  # asked inside: once the group is left, every process is rank 0
        print_outcome(args, metrics, run_dir, "trained")
    return 0


def print_metrics(metrics: dict) -> None:
    print(json.dumps({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, indent=1))


def print_outcome(args: argparse.Namespace, metrics: dict, run_dir: str, title: str) -> None:
    """The run's summary (metrics.jsonl keeps every figure), or with --json the last iteration's metrics."""
    from stppo_agent.runs.run_summary import run_summary

    if args.json:
        print_metrics(metrics)
    else:
        print(run_summary(run_dir, title))


def _train(args: argparse.Namespace) -> tuple[dict, str]:
    from stppo_agent.plugins.loader import portable_specs
    from stppo_agent.plugins.name_checks import check_train_config
    from stppo_agent.rollouts.envs import refuse_training_data_without_retriever
    from stppo_agent.training.config import load_config

    config_file = args.config
    if args.resume and config_file is None and args.output_dir and (Path(args.output_dir) / "config.yaml").exists():
        config_file = str(Path(args.output_dir) / "config.yaml")  # the run's own settings, resolved algorithm too
    config = load_config(config_file, args.overrides, algo=args.algo, env=args.env, model=args.model,
                         output_dir=args.output_dir, iterations=args.iterations)
    config.plugins = portable_specs([*config.plugins, *args.imports])
    check_train_config(config)  # plugins imported, then every name checked before a model loads
    refuse_training_data_without_retriever(config.env, config.env_kwargs or {})
    check_run_settings(config)
    # Only a config that passed every check pays for importing the trainer (transformers' modelling code, ~2 s).
    from stppo_agent.models.default_model import resolve_model
    from stppo_agent.training.trainer import Trainer

    config.model = resolve_model(config.model) if config.model else config.model
    return Trainer(config, resume=args.resume, overwrite=args.overwrite).train(), config.output_dir


def check_run_settings(config) -> None:
    """What the collapse guard and the checkpoints are told to do, checked before a model loads (with the closest
    valid value for a typo)."""
    from stppo_agent.monitoring.collapse_rules import check_action
    from stppo_agent.runs.checkpoint import check_checkpoint_settings

    check_action(config.monitor.on_collapse)
    check_checkpoint_settings(config.checkpoint.dtype, config.checkpoint.optimizer, config.monitor.on_collapse)
