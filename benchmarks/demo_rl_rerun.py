"""Rerun the RL step of a finished ``stppo demo`` on its own warm start, with changes to the recipe, then the demo's
evaluation, table and check line -- the way to try a recipe change on one seed without the warm start and the first
evaluation (about half the demo's time).

    OMP_NUM_THREADS=2 python benchmarks/demo_rl_rerun.py runs/demo runs/demo-k05 --seed 0 --dtype bfloat16 \\
        --alg clip_bias_kappa=0.5 --set samples_per_prompt=4

DEMO_DIR must hold the demo's ``sft`` (the warm-started model) and ``eval_before``. With the same seed, precision
and thread count as the demo, and no change, the rerun samples the same batch and prints the same RL line as the
demo did (torch's thread count changes the samples). ``--set`` takes TrainConfig fields, ``--alg`` the algorithm's;
values are JSON (``true``, ``4``, ``"x"``). One rerun needs as much memory as a demo: run them one at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from stppo_agent.training import demo
from stppo_agent.training.demo_progress import DemoProgress


def assignments(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = json.loads(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("demo_dir", type=Path, help="a finished demo's output folder (its sft and eval_before)")
    parser.add_argument("out", type=Path, help="where the rerun's run folder and evaluation go")
    parser.add_argument("--seed", type=int, required=True, help="the demo's --seed")
    parser.add_argument("--dtype", default="auto", choices=demo.AUTOCAST_CHOICES, help="the demo's --autocast-dtype")
    parser.add_argument("--lr", type=float, default=demo.DemoSettings.lr)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="a TrainConfig field")
    parser.add_argument("--alg", action="append", default=[], metavar="FIELD=JSON", help="an algorithm field")
    args = parser.parse_args()
    if not (args.demo_dir / "sft").is_dir() or not (args.demo_dir / "eval_before" / "results.json").is_file():
        parser.error(f"{args.demo_dir} holds no finished demo (its sft/ and eval_before/results.json)")
    settings = demo.DemoSettings(seed=args.seed, autocast_dtype=args.dtype, lr=args.lr, output_dir=str(args.out))
    config = demo.demo_config(settings, str(args.demo_dir / "sft"), args.out)
    config = dataclasses.replace(config, algorithm={**config.algorithm, **assignments(args.alg)},
                                 **assignments(args.set))
    before = json.loads((args.demo_dir / "eval_before" / "results.json").read_text())
    progress, started = DemoProgress(), time.perf_counter()
    with progress:
        demo.train_and_check(settings, config, progress, args.out, before)
    print(f"RL step and evaluation: {time.perf_counter() - started:.0f} s on {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
