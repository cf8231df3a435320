"""``SearchTool``: a verl ``BaseTool`` that searches through a retrieval server speaking Search-R1's ``/retrieve``
(``stppo serve``, one per node, or Search-R1's own server), for verl's tool agent (``agent_name: stppo_tool_agent``).

verl 0.8 removed its own search tool. This one answers exactly what the env would observe after a search: Search-R1's
``<information>Doc i(Title: ...) text</information>`` block (``stppo_envs.prompts.format_information``), the query
cleaned as the env cleans it, and a failed search (a dead server, a refused query, or arguments the tool refuses) as
the env's ``<information>Search failed: ...</information>`` block rather than an exception. Tool config:
``examples/verl/search_tool_config.yaml``; the agent loop ``stppo_tool_agent`` (:mod:`.tool_agent`) records the turns
and scores the episode.
"""

from __future__ import annotations

import asyncio
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from stppo_envs.prompts import format_information, search_failure_observation
from stppo_envs.retrieval.base import RetrievalError, sanitize_query
from stppo_envs.retrieval.remote import RemoteRetriever

SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the knowledge corpus for passages relevant to the query.",
        "parameters": {"type": "object", "required": ["query_list"], "properties": {
            "query_list": {"type": "array", "items": {"type": "string"}, "description": "search queries"}}},
    },
}


class SearchTool(BaseTool):
    """Config keys: ``retrieval_service_url`` (``http://host:port`` or ``.../retrieve``; the key Search-R1's verl
    recipe used), ``topk`` (3), ``timeout`` (30 s), ``retries`` (2). Parameters: ``query_list`` (Search-R1's recipe)
    or ``query``; one ``<information>`` block per query."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(SCHEMA))
        url = config.get("retrieval_service_url") or config.get("url")
        if not url:
            raise ValueError("SearchTool needs config.retrieval_service_url (a `stppo serve` URL)")
        self.topk = int(config.get("topk", 3))
        self.retriever = RemoteRetriever(url, timeout=float(config.get("timeout", 30.0)),
                                         retries=int(config.get("retries", 2)))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float,
                                                                                              dict]:
        queries = parameters.get("query_list", parameters.get("query"))
        if isinstance(queries, str):
            queries = [queries]
        if not queries or not all(isinstance(q, str) and q.strip() for q in queries):
            refusal = ValueError("query_list must be a list of non-empty strings")
            return ToolResponse(text=search_failure_observation(refusal)), 0.0, {"search_errors": 1}
        text, errors = await asyncio.to_thread(self.search, [sanitize_query(q) for q in queries])
        return ToolResponse(text=text), 0.0, {"queries": len(queries), "search_errors": errors}

    def search(self, queries: list[str]) -> tuple[str, int]:
        """(the observation for ``queries``, how many failed)."""
        blocks, errors = [], 0
        for query in queries:  # one request per query: a refused query fails alone, as in the env
            try:
                blocks.append(format_information(self.retriever.search(query, self.topk)))
            except RetrievalError as error:
                blocks.append(search_failure_observation(error))
                errors += 1
        return "".join(blocks), errors
