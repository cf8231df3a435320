"""Recall@k of the supporting titles on HotpotQA-distractor-100, for BM25 and dense (all-MiniLM-L6-v2).

    python benchmarks/retrieval_recall.py

A retrieval-quality figure to report, not a threshold: for each question, the fraction of its supporting
titles found in the top k passages (recall), and how often all of them are (all-found).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from _common import cached_index, shared_data

from stppo_envs.retrieval import make_retriever
from stppo_envs.retrieval.indexing import iter_corpus

KS = (1, 3, 5, 10, 20)


def main() -> None:
    data = shared_data()
    questions = json.loads((data / "qa/hotpotqa_distractor_100.json").read_text())
    corpus_json = data / "corpus/hotpotqa_distractor_100_corpus.json"
    corpus = Path(tempfile.mkdtemp()) / "hotpot_corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as out:  # title -> sentences, as title/text records
        for docid, title, text in iter_corpus(corpus_json):
            out.write(json.dumps({"id": docid, "title": title, "text": text}) + "\n")
    print(f"{len(questions)} questions, corpus {sum(1 for _ in open(corpus))} passages")
    print(f"{'backend':8s} " + " ".join(f"R@{k:<3d} all@{k:<3d}" for k in KS))
    for kind in ("bm25", "dense"):
        retriever = make_retriever(f"{kind}:{cached_index(kind, corpus, 'hotpot100')}", cache_size=0)
        results = retriever.batch_search([q["question"] for q in questions], max(KS))
        cells = []
        for k in KS:
            recalls, complete = [], []
            for question, hits in zip(questions, results):
                gold = {title for title, _ in question["supporting_facts"]}
                found = gold & {hit.title for hit in hits[:k]}
                recalls.append(len(found) / len(gold))
                complete.append(found == gold)
            cells.append(f"{sum(recalls) / len(recalls):.3f} {sum(complete) / len(complete):.3f} ")
        print(f"{kind:8s} " + " ".join(cells))


if __name__ == "__main__":
    main()
