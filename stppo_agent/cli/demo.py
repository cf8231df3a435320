"""``stppo demo``: the embedded default (warm start, ST-PPO, evaluation before and after RL) in one command."""

from __future__ import annotations

import argparse

from stppo_agent.cli.arguments import positive_int

# the recipe's defaults live in DemoSettings alone (stppo_agent.training.demo); imported lazily there, so these
# mirror them and tests/training/test_sft.py checks that they agree
DEMO_DEFAULTS = {"iterations": 1, "sft_steps": 8, "limit": 8, "lr": 1.5e-5, "seed": 0, "autocast_dtype": "auto"}


def add_parser(commands) -> None:
    demo = commands.add_parser("demo", help="the embedded default: SFT warm start + ST-PPO on SmolLM2-135M, "
                                             "demo data, on a GPU when there is one, else the CPU")
    d = DEMO_DEFAULTS
    demo.add_argument("--iterations", type=positive_int, default=d["iterations"],
                      help=f"training iterations (default {d['iterations']})")
    demo.add_argument("--sft-steps", type=int, default=d["sft_steps"],
                      help=f"warm-start steps before RL; 0 skips it and the evaluation before RL "
                           f"(default {d['sft_steps']})")
    demo.add_argument("--limit", type=positive_int, default=d["limit"],
                      help=f"evaluation examples per benchmark, before and after RL (default {d['limit']})")
    demo.add_argument("--model", default="smollm2", help="model to train (default: SmolLM2-135M-Instruct)")
    demo.add_argument("--output-dir", default="runs/demo", help="run folder (default runs/demo)")
    demo.add_argument("--lr", type=float, default=d["lr"], help=f"ST-PPO actor learning rate (default {d['lr']})")
    demo.add_argument("--on-collapse", choices=("none", "warn", "stop", "rollback"), default="warn",
                      help="what a collapse alarm does (rollback checkpoints every iteration; default warn)")
    demo.add_argument("--seed", type=int, default=d["seed"],
                      help=f"seed of the warm start's batch order and the RL step's prompts and samples "
                           f"(default {d['seed']})")
    demo.add_argument("--autocast-dtype", choices=("auto", "bfloat16", "none"), default=d["autocast_dtype"],
                      help="the RL step's forwards: auto (bfloat16 on a GPU or a CPU with AMX, else float32), "
                           "bfloat16 (as such machines run them, anywhere) or none (float32)")
    demo.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from stppo_agent.training.demo import DemoSettings, run_demo

    # a figure outside its expected range is said on the "check:" line, not in the exit status: the run worked
    run_demo(DemoSettings(model=args.model, output_dir=args.output_dir, iterations=args.iterations,
                          sft_steps=args.sft_steps, limit=args.limit, lr=args.lr, on_collapse=args.on_collapse,
                          seed=args.seed, autocast_dtype=args.autocast_dtype))
    return 0
