"""Queries/second of the env's batched search against raw pyserini and raw faiss, on the same queries.

    python benchmarks/retrieval.py [--queries 640] [--batch 64]

"env" is a ``make_vec`` step in which every sub-env searches (parsing, one ``batch_search``, formatting the
``<information>`` observations); the raw baselines call the libraries directly and fetch the passage text
(a search tool has to return it). Target: env >= 0.8x raw (our overhead under 25%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from _common import cached_index, minilm_path, shared_data

from stppo_envs import make_vec
from stppo_envs.retrieval import make_retriever


def env_qps(spec: str, queries: list[str], batch: int, rounds: int = 3) -> float:
    envs = make_vec("stppo/NQ-v0", batch, retriever=make_retriever(spec, cache_size=0), max_turns=8, topk=3)
    best = float("inf")
    for _ in range(rounds):
        elapsed = 0.0
        for start in range(0, len(queries), batch):
            chunk = queries[start:start + batch]
            envs.reset(seed=0)
            actions = [f"<think>look up</think><search>{q}</search>" for q in chunk]
            actions += ["<search>x</search>"] * (batch - len(chunk))
            began = time.perf_counter()
            envs.step(actions)
            elapsed += time.perf_counter() - began
        best = min(best, elapsed)
    return len(queries) / best


def raw_pyserini_qps(index: str, queries: list[str], batch: int, rounds: int = 3) -> float:
    from pyserini.search.lucene import LuceneSearcher

    searcher = LuceneSearcher(index)
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        for start in range(0, len(queries), batch):
            chunk = queries[start:start + batch]
            results = searcher.batch_search(chunk, [str(i) for i in range(len(chunk))], k=3, threads=1)
            texts = [json.loads(hit.lucene_document.get("raw"))["contents"]
                     for hits in results.values() for hit in hits]
            assert texts
        best = min(best, time.perf_counter() - began)
    return len(queries) / best


def raw_faiss_qps(index_dir, queries: list[str], batch: int, rounds: int = 3) -> float:
    import datasets
    import faiss
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    model = AutoModel.from_pretrained(minilm_path()).eval()
    index = faiss.read_index(str(index_dir / "index.faiss"))
    docs = datasets.load_from_disk(str(index_dir / "docs"))
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        for start in range(0, len(queries), batch):
            with torch.no_grad():
                tokens = tokenizer(queries[start:start + batch], padding=True, truncation=True, max_length=256,
                                   return_tensors="pt")
                hidden = model(**tokens).last_hidden_state
                weights = tokens["attention_mask"].unsqueeze(-1).float()
                vectors = torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)
            _, ids = index.search(vectors.numpy().astype(np.float32), 3)
            texts = docs.select(sorted({int(i) for row in ids for i in row}))["text"]
            assert texts
        best = min(best, time.perf_counter() - began)
    return len(queries) / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queries", type=int, default=640)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds; the first two are warm-up")
    args = parser.parse_args()
    data = shared_data()
    corpus = data / "corpus/wiki_dpr_sample_1000.jsonl"
    with open(data / "qa/nq_open_dev.jsonl", encoding="utf-8") as handle:
        queries = [json.loads(line)["question"] for _, line in zip(range(args.queries), handle)]
    bm25_index = cached_index("bm25", corpus, "wiki1000")
    dense_index = cached_index("dense", corpus, "wiki1000")
    # The JVM's JIT needs a few passes to settle; alternate env and raw so both see the same machine state.
    rows = []
    for name, ours, raw in (("bm25", lambda: env_qps(f"bm25:{bm25_index}", queries, args.batch, rounds=1),
                             lambda: raw_pyserini_qps(str(bm25_index), queries, args.batch, rounds=1)),
                            ("dense", lambda: env_qps(f"dense:{dense_index}", queries, args.batch, rounds=1),
                             lambda: raw_faiss_qps(dense_index, queries, args.batch, rounds=1))):
        samples = [(ours(), raw()) for _ in range(args.rounds)][2:]
        ratios = [o / r for o, r in samples]  # paired: env and raw ran back to back in each round
        rows.append((name, max(o for o, _ in samples), max(r for _, r in samples), ratios))
    print(f"{len(queries)} NQ queries, batches of {args.batch}, top-3, wiki-18 sample of 1000 passages; best q/s "
          f"of {args.rounds - 2} rounds, env / raw as the median (min-max) of the rounds' ratios")
    print(f"{'backend':8s} {'env q/s':>10s} {'raw q/s':>10s} {'env / raw':>20s}")
    for name, ours, raw, ratios in rows:
        spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"{name:8s} {ours:10.1f} {raw:10.1f} {spread:>20s}")


if __name__ == "__main__":
    main()
