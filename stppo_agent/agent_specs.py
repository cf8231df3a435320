"""Agent specs on the command line: scripted baselines now; ``hf:PATH`` and ``openai:URL#MODEL`` build LLM agents."""

from __future__ import annotations

from typing import Sequence

from stppo_envs import Example

from .agents import SCRIPTED_AGENTS, Agent

SPEC_HELP = "agent specs: " + ", ".join(sorted(SCRIPTED_AGENTS))


def build_agent(spec: str, examples: Sequence[Example]) -> Agent:
    """An agent from its spec string; ``examples`` are given to agents that need them (the oracle)."""
    if spec in SCRIPTED_AGENTS:
        return SCRIPTED_AGENTS[spec](examples)
    raise ValueError(f"unknown agent spec {spec!r}; {SPEC_HELP}")
