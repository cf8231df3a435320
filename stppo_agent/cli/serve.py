"""``stppo serve``: a retriever over HTTP with Search-R1's ``/retrieve`` API."""

from __future__ import annotations

import argparse


def add_parser(commands) -> None:
    from stppo_envs.retrieval.server import ServerLimits

    srv = commands.add_parser("serve", help="serve a retriever over HTTP with Search-R1's /retrieve API")
    srv.add_argument("--retriever", required=True, help="demo, bm25:DIR, dense:DIR")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default: no authentication)")
    srv.add_argument("--port", type=int, default=8000, help="port")
    srv.add_argument("--max-topk", type=int, default=ServerLimits.max_topk,
                     help=f"largest topk a request may ask for (default {ServerLimits.max_topk})")
    srv.add_argument("--max-queries", type=int, default=ServerLimits.max_queries,
                     help=f"queries per request (default {ServerLimits.max_queries}; Search-R1's GRPO recipe "
                          "sends 2,560)")
    srv.add_argument("--max-query-chars", type=int, default=ServerLimits.max_query_chars,
                     help=f"characters per query (default {ServerLimits.max_query_chars})")
    srv.add_argument("--max-body-mb", type=int, default=ServerLimits.max_body_bytes // 2**20,
                     help=f"request body size in MiB (default {ServerLimits.max_body_bytes // 2**20})")
    srv.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from stppo_agent.distributed.shared_retrieval import stop_with_parent
    from stppo_agent.plugins.name_checks import check_retriever
    from stppo_envs.retrieval import make_retriever
    from stppo_envs.retrieval.server import ServerLimits, serve

    stop_with_parent()  # a training run's shared server stops with the run, even a killed one
    check_retriever(args.retriever)
    retriever = make_retriever(args.retriever)
    retriever.search("warm up", 1)  # load the index (and start the JVM) before accepting requests
    serve(retriever, args.host, args.port, ServerLimits(max_topk=args.max_topk, max_queries=args.max_queries,
                                                        max_query_chars=args.max_query_chars,
                                                        max_body_bytes=args.max_body_mb * 2**20))
    return 0
