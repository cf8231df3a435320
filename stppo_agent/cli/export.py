"""``stppo export verl``: the benchmarks as verl's parquet (prompt, ground truth, the env's settings per row) for
``verl.trainer.main_ppo`` with the ``stppo_env`` or ``stppo_tool_agent`` agent loop (docs/verl.md)."""

from __future__ import annotations

import argparse

from stppo_agent.cli.arguments import distinct_benchmarks, positive_int

AGENT_LOOPS = ("stppo_env", "stppo_tool_agent")  # stppo_agent.integrations.verl.data.AGENT_LOOPS (imports datasets)
REWARDS = ("auto", "em", "f1", "acc")


def add_parser(commands) -> None:
    export = commands.add_parser("export", help="write the benchmarks in another framework's data format")
    formats = export.add_subparsers(dest="format", required=True)
    verl = formats.add_parser("verl", help="verl's parquet, one file per benchmark: DIR/<benchmark>_<split>.parquet")
    verl.add_argument("--benchmarks", required=True, help="comma-separated, e.g. nq,hotpotqa")
    verl.add_argument("--split", required=True, help="split to export, e.g. train or test")
    verl.add_argument("--out", required=True, help="folder for the parquet files")
    verl.add_argument("--dataset", default=None,
                      help="the env's dataset for every benchmark: a FlashRAG-style folder, 'hub', or the bundled demo "
                           "set when unset")
    verl.add_argument("--limit", type=positive_int, default=None, help="first N examples of each benchmark")
    verl.add_argument("--max-turns", type=positive_int, default=4,
                      help="env steps per episode, recorded per row for the agent loop and the reward function")
    verl.add_argument("--reward", choices=REWARDS, default="auto",
                      help="the env's reward: exact match, token F1 or option accuracy (auto: acc for multiple choice, "
                           "em otherwise)")
    verl.add_argument("--format-reward", type=float, default=0.0, help="reward of a well-formed wrong answer")
    verl.add_argument("--no-question-mark", dest="question_mark", action="store_false",
                      help="keep open-domain questions as the dataset gives them (the env adds '?' by default)")
    verl.add_argument("--agent-loop", choices=AGENT_LOOPS, default="stppo_env",
                      help="the verl agent loop that plays the rows: the env itself, or verl's tool agent with the "
                           "search tool (its prompt asks for the tool call)")
    verl.set_defaults(handler=run_verl)


def run_verl(args: argparse.Namespace) -> int:
    benchmarks = distinct_benchmarks(args.benchmarks)  # one named twice would write its file twice
    if not benchmarks:
        raise ValueError(f"--benchmarks {args.benchmarks!r} names no benchmark; name at least one, e.g. nq,hotpotqa")
    from stppo_agent.integrations.verl.data import export_verl

    for path in export_verl(benchmarks, args.split, args.out, dataset=args.dataset, limit=args.limit,
                            max_turns=args.max_turns, reward=args.reward, format_reward=args.format_reward,
                            question_mark=args.question_mark, agent_name=args.agent_loop):
        print(path)
    return 0
