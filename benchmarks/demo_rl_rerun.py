"""Rerun the RL step of a finished ``stppo demo`` on its own warm start, with changes to the recipe, then the demo's
evaluation, table and check line -- the way to try a recipe change on one seed without the warm start and the first
evaluation (about half the demo's time).

    OMP_NUM_THREADS=2 python benchmarks/demo_rl_rerun.py runs/demo runs/demo-k05 --seed 0 --dtype bfloat16 \\
        --set algorithm.clip_bias_kappa=0.5 --set rollout.samples_per_prompt=4

DEMO_DIR must hold the demo's ``sft`` (the warm-started model) and ``eval_before``. With the same seed, precision
and thread count as the demo, and no change, the rerun samples the same batch and prints the same RL line as the
demo did (torch's thread count changes the samples). ``--set`` takes the keys ``stppo train --set`` takes
(``rollout.samples_per_prompt=4``, ``algorithm.clip_bias_kappa=0.5``). One rerun needs as much memory as a demo:
run them one at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import yaml

from stppo_agent.training import demo
from stppo_agent.training.config import TrainConfig, from_dict, set_value
from stppo_agent.training.demo_progress import DemoProgress


def with_settings(config: TrainConfig, settings: list[str]) -> TrainConfig:
    """``config`` with ``--set key=value`` applied as ``stppo train`` applies them (names checked, values YAML)."""
    values = dataclasses.asdict(config)
    for item in settings:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        set_value(values, key.strip(), yaml.safe_load(raw))
    return from_dict(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("demo_dir", type=Path, help="a finished demo's output folder (its sft and eval_before)")
    parser.add_argument("out", type=Path, help="where the rerun's run folder and evaluation go")
    parser.add_argument("--seed", type=int, required=True, help="the demo's --seed")
    parser.add_argument("--dtype", default="auto", choices=demo.AUTOCAST_CHOICES, help="the demo's --autocast-dtype")
    parser.add_argument("--lr", type=float, default=demo.DemoSettings.lr)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting, as stppo train --set takes it (rollout.samples_per_prompt=4)")
    args = parser.parse_args()
    if not (args.demo_dir / "sft").is_dir() or not (args.demo_dir / "eval_before" / "results.json").is_file():
        parser.error(f"{args.demo_dir} holds no finished demo (its sft/ and eval_before/results.json)")
    settings = demo.DemoSettings(seed=args.seed, autocast_dtype=args.dtype, lr=args.lr, output_dir=str(args.out))
    config = demo.demo_config(settings, str(args.demo_dir / "sft"), args.out)
    config = with_settings(config, args.set)
    before = json.loads((args.demo_dir / "eval_before" / "results.json").read_text())
    progress, started = DemoProgress(), time.perf_counter()
    with progress:
        demo.train_and_check(settings, config, progress, args.out, before)
    print(f"RL step and evaluation: {time.perf_counter() - started:.0f} s on {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
