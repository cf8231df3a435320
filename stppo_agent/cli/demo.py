"""``stppo demo``: the embedded default (warm start, ST-PPO, per-benchmark evaluation) in one command."""

from __future__ import annotations

import argparse

from stppo_agent.cli.arguments import positive_int

DEMO_LR = 1e-5


def add_parser(commands) -> None:
    demo = commands.add_parser("demo", help="the embedded default: SFT warm start + ST-PPO on SmolLM2-135M, "
                                             "demo data, on a GPU when there is one, else the CPU")
    demo.add_argument("--iterations", type=positive_int, default=3, help="training iterations (default 3)")
    demo.add_argument("--sft-steps", type=int, default=20, help="warm-start steps before RL; 0 skips it (default 20)")
    demo.add_argument("--limit", type=positive_int, default=16, help="evaluation examples per benchmark (default 16)")
    demo.add_argument("--model", default="smollm2", help="model to train (default: SmolLM2-135M-Instruct)")
    demo.add_argument("--output-dir", default="runs/demo", help="run folder (default runs/demo)")
    demo.add_argument("--lr", type=float, default=DEMO_LR, help=f"ST-PPO actor learning rate (default {DEMO_LR})")
    demo.add_argument("--on-collapse", choices=("none", "warn", "stop", "rollback"), default="warn",
                      help="what a collapse alarm does (rollback checkpoints every iteration; default warn)")
    demo.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from stppo_agent.training.demo import DemoSettings, run_demo

    run_demo(DemoSettings(model=args.model, output_dir=args.output_dir, iterations=args.iterations,
                          sft_steps=args.sft_steps, limit=args.limit, lr=args.lr, on_collapse=args.on_collapse))
    return 0
