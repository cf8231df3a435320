"""Agent specs on the command line: scripted baselines now; ``hf:PATH`` and ``openai:URL#MODEL`` build LLM agents."""

from __future__ import annotations

import functools
from typing import Sequence

from stppo_envs import Example

from .agents import SCRIPTED_AGENTS, Agent

SPEC_HELP = ("agent specs: hf:PATH (a checkpoint folder, or hf:smollm2), openai:http://HOST:PORT/v1#MODEL, "
             + ", ".join(sorted(SCRIPTED_AGENTS)))


@functools.lru_cache(maxsize=2)
def _hf_agent(path: str, max_new_tokens: int) -> Agent:
    """One loaded model serves every benchmark of an evaluation."""
    from .hf_agent import HFAgent

    return HFAgent(path, max_new_tokens=max_new_tokens)


def build_agent(spec: str, examples: Sequence[Example], max_new_tokens: int = 256) -> Agent:
    """An agent from its spec string; ``examples`` are given to agents that need them (the oracle)."""
    if spec in SCRIPTED_AGENTS:
        return SCRIPTED_AGENTS[spec](examples)
    if spec.startswith("hf:") and len(spec) > 3:
        return _hf_agent(spec[3:], max_new_tokens)
    if spec.startswith("openai:"):
        from .openai_agent import OpenAIChatAgent

        return OpenAIChatAgent.from_spec(spec[len("openai:"):], max_tokens=max_new_tokens)
    raise ValueError(f"unknown agent spec {spec!r}; {SPEC_HELP}")
