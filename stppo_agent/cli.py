"""The ``stppo`` command (``python -m stppo_agent.cli`` is the same)."""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

DEMO_BENCHMARKS = ("nq", "hotpotqa", "medqa")
QA_FAMILY_ORDER = ("nq", "triviaqa", "popqa", "hotpotqa", "2wiki", "musique", "bamboogle")


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    from stppo_envs.retrieval import RetrievalError

    try:
        return args.handler(args) or 0
    except (FileNotFoundError, FileExistsError, ValueError, KeyError, RetrievalError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"stppo {args.command}: error: {message}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stppo", description=__doc__)
    commands = parser.add_subparsers(dest="command")

    demo = commands.add_parser("demo", help="the embedded default: scripted agents on the bundled demo set")
    demo.add_argument("--limit", type=int, default=None, help="examples per benchmark (default: all)")
    demo.add_argument("--output-dir", default=None, help="where to write results (default: a temp folder)")
    demo.set_defaults(handler=_run_demo)

    ev = commands.add_parser("eval", help="evaluate an agent per benchmark")
    ev.add_argument("--agent", required=True, help="oracle, no-search, search-copy")
    ev.add_argument("--benchmarks", required=True, help="comma-separated, e.g. nq,hotpotqa,medqa")
    ev.add_argument("--dataset", action="append", default=[], metavar="BENCH=PATH",
                    help="data source per benchmark (file, folder or hub name); default: the demo set")
    ev.add_argument("--split", default=None, help="split (default: each benchmark's evaluation split)")
    ev.add_argument("--limit", type=int, default=None, help="first N examples of each benchmark")
    ev.add_argument("--retriever", default="demo", help="demo, bm25:DIR, dense:DIR, http://HOST:PORT")
    ev.add_argument("--topk", type=int, default=3)
    ev.add_argument("--max-turns", type=int, default=4)
    ev.add_argument("--batch-size", type=int, default=32)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--output-dir", required=True)
    ev.set_defaults(handler=_run_eval)

    index = commands.add_parser("index", help="build a search index from a pyserini/FlashRAG corpus")
    index_kinds = index.add_subparsers(dest="kind", required=True)
    bm25 = index_kinds.add_parser("bm25", help="Lucene BM25 index with pyserini")
    bm25.add_argument("--corpus", required=True, help='JSONL with {"id", "contents"} (or a folder of them)')
    bm25.add_argument("--out", required=True)
    bm25.add_argument("--threads", type=int, default=1)
    bm25.set_defaults(handler=_run_index_bm25)
    dense = index_kinds.add_parser("dense", help="faiss index of passages embedded by a Hugging Face encoder")
    dense.add_argument("--corpus", required=True, help='JSONL with {"id", "contents"}, or title/text records')
    dense.add_argument("--encoder", required=True, help="local folder or hub name of the encoder")
    dense.add_argument("--out", required=True)
    dense.add_argument("--index-type", default="flat", choices=["flat", "hnsw", "ivf"])
    dense.add_argument("--batch-size", type=int, default=64)
    dense.add_argument("--shard-size", type=int, default=4096, help="passages per resumable shard")
    dense.add_argument("--device", default=None)
    dense.set_defaults(handler=_run_index_dense)

    srv = commands.add_parser("serve", help="serve a retriever over HTTP with Search-R1's /retrieve API")
    srv.add_argument("--retriever", required=True, help="demo, bm25:DIR, dense:DIR")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default: no authentication)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-topk", type=int, default=100)
    srv.add_argument("--max-queries", type=int, default=1024, help="queries per request")
    srv.set_defaults(handler=_run_serve)
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="stppo-demo-"))
    print("stppo demo: scripted agents on the bundled demo set (BM25 over the demo corpus, top-3, 4 turns)")
    for agent in ("oracle", "search-copy", "no-search"):
        results = _evaluate_all(agent, DEMO_BENCHMARKS, {}, None, args.limit, "demo", 3, 4, 32, 0)
        _write_results(results, out / agent)
        print(f"\nagent: {agent}")
        print(format_table(results))
    print(f"\nresults written under {out}")
    return 0


def _run_eval(args: argparse.Namespace) -> int:
    benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    datasets = dict(_key_value(item) for item in args.dataset)
    results = _evaluate_all(args.agent, benchmarks, datasets, args.split, args.limit, args.retriever, args.topk,
                            args.max_turns, args.batch_size, args.seed)
    _write_results(results, Path(args.output_dir))
    print(format_table(results))
    return 0


def _run_index_bm25(args: argparse.Namespace) -> int:
    from stppo_envs.retrieval.indexing import build_bm25_from_corpus

    out = build_bm25_from_corpus(args.corpus, args.out, threads=args.threads)
    print(f"BM25 index written to {out}; use it with --retriever bm25:{out}")
    return 0


def _run_index_dense(args: argparse.Namespace) -> int:
    from stppo_envs.retrieval.dense import build_dense_index

    out = build_dense_index(args.corpus, args.out, args.encoder, index_type=args.index_type,
                            shard_size=args.shard_size, batch_size=args.batch_size, device=args.device)
    print(f"dense index written to {out}; use it with --retriever dense:{out}")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from stppo_envs.retrieval import make_retriever
    from stppo_envs.retrieval.server import ServerLimits, serve

    retriever = make_retriever(args.retriever)
    retriever.search("warm up", 1)  # load the index (and start the JVM) before accepting requests
    serve(retriever, args.host, args.port, ServerLimits(max_topk=args.max_topk, max_queries=args.max_queries))
    return 0


def _evaluate_all(agent: str, benchmarks: Sequence[str], datasets: dict[str, str], split, limit, retriever,
                  topk, max_turns, batch_size, seed) -> list[dict[str, Any]]:
    from stppo_envs import benchmark_info

    from .evaluate import EvalSettings, evaluate_benchmark

    names = [benchmark_info(b).name for b in benchmarks]  # fail fast on unknown names, before any work
    return [evaluate_benchmark(agent, EvalSettings(name, datasets.get(name), split, limit, retriever, topk,
                                                   max_turns, batch_size, seed)) for name in names]


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"expected BENCH=PATH, got {item!r}")
    from stppo_envs import benchmark_info

    return benchmark_info(key).name, value


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table, one row per benchmark, plus the QA-family average as in Search-R1's tables."""
    header = ["benchmark", "n", "EM/acc", "F1", "answer", "invalid", "turns", "searches"]
    rows = []
    for result in results:
        m = result["metrics"]
        rows.append([result["benchmark"], str(m["n"]), f"{m.get('em', m.get('acc', 0.0)):.3f}",
                     f"{m['f1']:.3f}" if "f1" in m else "-", f"{m['answer_rate']:.3f}",
                     f"{m['invalid_action_rate']:.3f}", f"{m['mean_turns']:.2f}", f"{m['mean_search_calls']:.2f}"])
    qa = [r["metrics"]["em"] for r in results if "em" in r["metrics"]]
    if len(qa) > 1:
        rows.append(["QA avg (EM)", "", f"{sum(qa) / len(qa):.3f}", "", "", "", "", ""])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _write_results(results: Sequence[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = [{k: v for k, v in r.items() if k != "episodes"} for r in results]
    (out / "results.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    with open(out / "episodes.jsonl", "w", encoding="utf-8") as handle:
        for result in results:
            for episode in result["episodes"]:
                handle.write(json.dumps({"benchmark": result["benchmark"], **episode}, sort_keys=True) + "\n")
    metric_names = sorted({k for r in results for k in r["metrics"]})
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["benchmark", *metric_names])
        for r in results:
            writer.writerow([r["benchmark"], *(r["metrics"].get(k, "") for k in metric_names)])


if __name__ == "__main__":
    sys.exit(main())
