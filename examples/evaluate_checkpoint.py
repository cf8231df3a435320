"""Evaluate a checkpoint (or any agent spec) on every benchmark and print one table.

    python examples/evaluate_checkpoint.py runs/demo/train/checkpoints/step-3/actor [--data ../shared/data]

With ``--data`` pointing at the real slices (or your FlashRAG / MIRAGE files laid out the same way) each
benchmark reads its file; without it, the bundled demo set stands in. The same as `stppo eval`, as a script.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stppo_agent.evaluation.evaluate import EvalSettings, evaluate_benchmark
from stppo_agent.evaluation.results import format_table

FILES = {"nq": "qa/nq_open_dev.jsonl", "hotpotqa": "qa/hotpotqa_dev.json", "bamboogle": "qa/bamboogle_test.csv",
         "musique": "qa/musique_100.json", "medqa": "medical/medqa_us_4opt_test.jsonl",
         "medmcqa": "medical/medmcqa_dev.jsonl", "pubmedqa": "medical/pubmedqa_test.json",
         "mmlu_med": "medical/mmlu_med"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint", help="a Hugging Face folder, or an agent spec such as oracle")
    parser.add_argument("--data", default=None, help="folder laid out like ../shared/data")
    parser.add_argument("--retriever", default="demo")
    parser.add_argument("--limit", type=int, default=50)
    args = parser.parse_args()
    spec = args.checkpoint if args.checkpoint in ("oracle", "no-search", "search-copy") else f"hf:{args.checkpoint}"
    results = []
    for benchmark, path in FILES.items():
        dataset = str(Path(args.data) / path) if args.data else None
        results.append(evaluate_benchmark(spec, EvalSettings(benchmark, dataset, limit=args.limit,
                                                             retriever=args.retriever)))
    print(format_table(results))


if __name__ == "__main__":
    main()
