"""Agent specs on the command line: scripted baselines now; ``hf:PATH`` and ``openai:URL#MODEL`` build LLM agents."""

from __future__ import annotations

import functools
from typing import Sequence

from stppo_envs import Example

from .agents import SCRIPTED_AGENTS, Agent

SPEC_HELP = ("agent specs: hf:PATH (a checkpoint folder, or hf:smollm2), hf:RUN@best|@latest|@healthy|@STEP (a "
             "checkpoint of a training run), openai:http://HOST:PORT/v1#MODEL, " + ", ".join(sorted(SCRIPTED_AGENTS)))


def resolve_agent_spec(spec: str) -> tuple[str, str | None]:
    """``hf:RUN@best`` (or a bare run folder: its latest) -> ``hf:RUN/checkpoints/step-N/actor``, so results name
    the checkpoint they measured; other specs are returned unchanged. Also returns a line saying what was chosen."""
    from pathlib import Path

    from .run_folder import is_run_folder, pick_checkpoint

    if not spec.startswith("hf:"):
        return spec, None
    base, sep, which = spec[3:].rpartition("@")
    run, which = (Path(base), which) if sep and is_run_folder(Path(base)) else (Path(spec[3:]), "latest")
    if not is_run_folder(run):
        return spec, None
    folder, why = pick_checkpoint(run, which)
    return f"hf:{folder / 'actor'}", f"{spec} -> {why}"


def _hf_agent(path: str, max_new_tokens: int) -> Agent:
    """One loaded model serves every benchmark of an evaluation; a checkpoint rewritten at the same path (a run
    trained again with --overwrite) is loaded afresh."""
    return _cached_hf_agent(path, max_new_tokens, _folder_stamp(path))


def _folder_stamp(path: str) -> tuple:
    from pathlib import Path

    folder = Path(path).expanduser()
    if not folder.is_dir():
        return ()  # a model name (hf:smollm2): resolved to a cache that does not change under us
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file())


@functools.lru_cache(maxsize=2)
def _cached_hf_agent(path: str, max_new_tokens: int, stamp: tuple) -> Agent:
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
