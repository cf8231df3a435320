"""A retrieval server speaking Search-R1's API, so one index serves many rollout workers.

    POST /retrieve {"queries": [...], "topk": 3, "return_scores": true}
      -> {"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}   (bare documents without scores)
         + "errors": [{"index": i, "type", "message"}, ...]   only when the backend refused some queries
    GET  /health   -> {"status": "ok", "retriever": ..., "queries_served": n}

Concurrent requests are gathered for a few milliseconds and served by one ``batch_search`` call per top-k on a
single worker thread (pyserini and faiss are fastest batched, and the JVM is not shared across threads
arbitrarily). Limits on request size, query count, query length and top-k answer 4xx with a message.

A query the backend refuses (Lucene's TooManyClauses for a query of over 1,024 distinct terms) fails alone: its
row is ``[]`` and ``errors`` says why, while the other queries of the batch -- the sender's and those merged
from other clients -- are answered. 503 means only that the backend is unreachable, which clients retry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from pydantic import BaseModel

from .base import RetrievalError, Retriever, RetrieverUnavailableError, is_valid_unicode, search_each


class RetrieveRequest(BaseModel):
    """Search-R1's request body."""

    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for. The defaults accept what Search-R1's recipes send in one request (its GRPO
    recipe: 512 prompts x 5 samples = 2,560 queries; 8,192 for 1,024 x 8) with room to spare: its client
    crashes on an error answer, so a limit that bites must be raised on the command line, not discovered."""

    max_queries: int = 16384
    max_topk: int = 100
    max_query_chars: int = 16384
    max_body_bytes: int = 64 * 1024 * 1024
    default_topk: int = 3
    batch_window_s: float = 0.002
    max_batch_queries: int = 4096


class _Batcher:
    """Collects (queries, k) requests arriving within a short window and serves them with one call per k.

    ``search`` answers ``(rows, errors)`` for its own queries only: a query the backend refuses is an entry of
    ``errors`` (its row None) and never fails the queries merged with it, the sender's or anyone else's. Only a
    backend that is itself unreachable (:class:`RetrieverUnavailableError`) fails whole requests.
    """

    def __init__(self, retriever: Retriever, limits: ServerLimits):
        self.retriever, self.limits = retriever, limits
        self.queue: asyncio.Queue | None = None
        self.queries_served = 0
        self.batches_served = 0

    async def search(self, queries: list[str], k: int) -> tuple[list, dict[int, RetrievalError]]:
        if self.queue is None:
            self.queue = asyncio.Queue()
            asyncio.get_running_loop().create_task(self._serve_forever())
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((queries, k, future))
        return await future

    async def _serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pending = [await self.queue.get()]
            deadline = loop.time() + self.limits.batch_window_s
            count = len(pending[0][0])
            while count < self.limits.max_batch_queries:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    pending.append(await asyncio.wait_for(self.queue.get(), timeout))
                    count += len(pending[-1][0])
                except asyncio.TimeoutError:
                    break
            for k in sorted({k for _, k, _ in pending}):
                group = [(q, f) for q, kk, f in pending if kk == k]
                try:
                    await self._serve_group(group, k)
                except Exception as exc:  # a bug here must fail these requests, not stop the loop serving all
                    for _, future in group:
                        future.done() or future.set_exception(exc)

    async def _serve_group(self, group: list[tuple[list[str], asyncio.Future]], k: int) -> None:
        flat = [query for queries, _ in group for query in queries]
        rows, errors = await asyncio.to_thread(search_each, self.retriever, flat, k, isolate=Exception)
        self.queries_served += len(flat) - len(errors)
        self.batches_served += 1
        offset = 0
        for queries, future in group:
            mine = {i - offset: e for i, e in errors.items() if offset <= i < offset + len(queries)}
            down = next((e for e in mine.values() if isinstance(e, RetrieverUnavailableError)), None)
            if not future.done():
                if down is not None:
                    future.set_exception(down)
                else:
                    future.set_result((rows[offset:offset + len(queries)], mine))
            offset += len(queries)


def create_app(retriever: Retriever, limits: ServerLimits = ServerLimits()):
    """The FastAPI application serving ``retriever``."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="stppo retrieval server", description="Search-R1-compatible /retrieve")
    batcher = _Batcher(retriever, limits)
    app.state.batcher = batcher


    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "retriever": repr(retriever), "index_id": getattr(retriever, "index_id", None),
                "queries_served": batcher.queries_served, "batches_served": batcher.batches_served}

    @app.post("/retrieve")
    async def retrieve(request: RetrieveRequest) -> dict[str, Any]:
        k = limits.default_topk if request.topk is None else request.topk
        if not 1 <= k <= limits.max_topk:
            raise HTTPException(422, f"topk must be between 1 and {limits.max_topk}, got {k}")
        if len(request.queries) > limits.max_queries:
            raise HTTPException(413, f"at most {limits.max_queries} queries per request, got {len(request.queries)}")
        too_long = [i for i, q in enumerate(request.queries) if len(q) > limits.max_query_chars]
        if too_long:
            raise HTTPException(422, f"queries {too_long[:5]} are longer than {limits.max_query_chars} characters")
        invalid = [i for i, q in enumerate(request.queries) if not is_valid_unicode(q)]
        if invalid:  # rejected here, alone, before it can be merged with other clients' queries
            raise HTTPException(422, f"queries {invalid[:5]} are not valid Unicode (lone surrogate code points)")
        try:
            rows, errors = await batcher.search(request.queries, k)
        except RetrieverUnavailableError as exc:  # the backend is down: 503, which clients retry
            raise HTTPException(503, f"retrieval failed: {exc}") from exc
        except Exception as exc:  # a server bug: 500, which clients do not retry
            raise HTTPException(500, f"retrieval failed: {type(exc).__name__}: {exc}") from exc
        answer: dict[str, Any] = {"result": [[_result_item(hit, request.return_scores) for hit in hits or []]
                                             for hits in rows]}
        if errors:  # Search-R1's clients read only "result", where a failed query is an empty list
            answer["errors"] = [{"index": i, "type": type(e).__name__, "message": str(e)}
                                for i, e in sorted(errors.items())]
        return answer

    return BodyLimit(app, limits.max_body_bytes)


class BodyLimit:
    """ASGI wrapper that enforces the request-body limit *while reading*: a declared Content-Length over the limit
    is refused before any byte is read, and a chunked upload (no Content-Length) is cut off as soon as it passes
    the limit, so memory stays bounded whatever a client sends. The 413 says ``Connection: close`` and the server
    closes the connection after it: a client still sending is cut off near the limit, not read to its end (time
    and bandwidth stay bounded too). Outermost, so the 413 is its own answer."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    # uvicorn calls an app with no arguments to see whether it is a factory; a wrapped __call__ (a mutation tool's
    # trampoline takes *args) would be taken for one. __call__ stays a bare delegate, exempt from mutation.
    async def __call__(self, scope, receive, send):  # pragma: no mutate block
        await self.serve(scope, receive, send)

    async def serve(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        received, refused = 0, False

        async def limited_receive():
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # answer now; the app sees a client that went away
                    refused = True
                    await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not refused:  # after the 413, nothing else goes out
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not refused:
                raise

    async def _refuse(self, send) -> None:
        body = json.dumps({"detail": f"request body over {self.limit} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _result_item(hit, with_score: bool) -> dict[str, Any]:
    document = {"id": hit.docid, "contents": hit.contents}
    return {"document": document, "score": hit.score} if with_score else document


def serve(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits = ServerLimits(),
          log_level: str = "info") -> None:
    """Run the server until interrupted (binds to loopback by default: the API has no authentication)."""
    import uvicorn

    uvicorn.run(create_app(retriever, limits), host=host, port=port, log_level=log_level)
