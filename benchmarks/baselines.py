"""Scripted baselines on the real slices of the fixture pack: a figure to report, not a threshold.

    python benchmarks/baselines.py [--limit 500]

The search-once-then-copy agent searches the question and answers with the top passage's title (QA) or the
option with the most word overlap with the passages (MCQ). Multi-hop slices use BM25 over their own
paragraph corpora; the others use the 1000-passage wiki-18 sample (which rarely holds the answer: a floor).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _common import cached_index, shared_data

from stppo_agent.evaluation.evaluate import EvalSettings, evaluate_benchmark
from stppo_agent.evaluation.results import format_table
from stppo_envs.retrieval.indexing import iter_corpus


def jsonl_corpus(source: Path, name: str) -> Path:
    out = Path(tempfile.mkdtemp()) / f"{name}.jsonl"
    with open(out, "w", encoding="utf-8") as handle:
        for docid, title, text in iter_corpus(source):
            handle.write(json.dumps({"id": docid, "title": title, "text": text}) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=int, default=500)
    args = parser.parse_args()
    data = shared_data()
    wiki = f"bm25:{cached_index('bm25', data / 'corpus/wiki_dpr_sample_1000.jsonl', 'wiki1000')}"
    hotpot_corpus = jsonl_corpus(data / "corpus/hotpotqa_distractor_100_corpus.json", "hp")
    hotpot = f"bm25:{cached_index('bm25', hotpot_corpus, 'hotpot100')}"
    musique = f"bm25:{cached_index('bm25', data / 'corpus/musique_100_corpus.json', 'musique100')}"
    runs = [("hotpotqa", "qa/hotpotqa_distractor_100.json", hotpot), ("musique", "qa/musique_100.json", musique),
            ("nq", "qa/nq_open_dev.jsonl", wiki), ("bamboogle", "qa/bamboogle_test.csv", wiki),
            ("medqa", "medical/medqa_us_4opt_test.jsonl", wiki), ("medmcqa", "medical/medmcqa_dev.jsonl", wiki),
            ("pubmedqa", "medical/pubmedqa_test.json", wiki), ("mmlu_med", "medical/mmlu_med", wiki)]
    results = [evaluate_benchmark("search-copy", EvalSettings(name, str(data / path), limit=args.limit,
                                                              retriever=retriever, batch_size=100))
               for name, path, retriever in runs]
    print(f"search-copy baseline, first {args.limit} examples per slice, BM25 top-3")
    print(format_table(results))


if __name__ == "__main__":
    main()
