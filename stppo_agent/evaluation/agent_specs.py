"""Agent specs on the command line: scripted baselines (and agents a plugin registers with :func:`register_agent`);
``hf:PATH`` and ``openai:URL#MODEL`` build LLM agents."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Callable, Sequence

from stppo_agent.evaluation.agents import DEFAULT_MAX_OBSERVATION_TOKENS, SCRIPTED_AGENTS, Agent, observation_budget
from stppo_envs import Example
from stppo_envs.suggest import did_you_mean

SPEC_HELP = ("agent specs: hf:PATH (a checkpoint folder, or hf:smollm2), hf:RUN@best|@latest|@healthy|@STEP (a "
             "checkpoint of a training run), openai:http://HOST:PORT/v1#MODEL, " + ", ".join(sorted(SCRIPTED_AGENTS)))
_PREFIXES = ("hf:", "openai:")


def register_agent(name: str, factory: Callable[[Sequence[Example]], Agent]) -> None:
    """Make ``--agent NAME`` (and ``stppo sft --teacher NAME``) build ``factory(examples)``; for plugins."""
    if not isinstance(name, str) or not name or name.startswith(_PREFIXES) or ":" in name:
        raise ValueError(f"agent names must be non-empty and have no ':' (it marks hf:/openai: specs), got {name!r}")
    if name in SCRIPTED_AGENTS:
        raise ValueError(f"agent {name!r} is already registered; choose another name")
    SCRIPTED_AGENTS[name] = factory


def check_agent_spec(spec: str) -> None:
    """A spec that is neither a known agent nor hf:/openai: is refused with the closest known name."""
    if spec in SCRIPTED_AGENTS or any(spec.startswith(p) and len(spec) > len(p) for p in _PREFIXES):
        return
    raise ValueError(f"unknown agent spec {spec!r}{did_you_mean(spec, SCRIPTED_AGENTS)}; {_spec_help()}")


def _spec_help() -> str:
    return SPEC_HELP.rsplit("#MODEL, ", 1)[0] + "#MODEL, " + ", ".join(sorted(SCRIPTED_AGENTS))


def resolve_agent_spec(spec: str) -> tuple[str, str | None]:
    """``hf:RUN@best`` (or a bare run folder: its latest) -> ``hf:RUN/checkpoints/step-N/actor``, so results name
    the checkpoint they measured; other specs are returned unchanged. Also returns a line saying what was chosen.

    A run folder without the checkpoint asked for, or a folder that does not exist, is a ``FileNotFoundError``
    saying so and listing what the folder holds (never a hub error about the path's characters)."""
    from stppo_agent.plugins.name_checks import check_model
    from stppo_agent.runs.checkpoint import list_checkpoints
    from stppo_agent.runs.run_folder import CHECKPOINT_CHOICES, is_run_folder, pick_checkpoint

    check_agent_spec(spec)
    if not spec.startswith("hf:"):
        return spec, None
    base, sep, which = spec[3:].rpartition("@")
    # a folder named with an @ (tiny@500) is what was typed, not a checkpoint of another folder
    asks_checkpoint = bool(sep) and not Path(spec[3:]).expanduser().is_dir() and (
        which in CHECKPOINT_CHOICES or which.isdigit() or is_run_like(Path(base)))
    if asks_checkpoint and which not in CHECKPOINT_CHOICES and not which.isdigit():
        hint = did_you_mean(f"@{which}", [f"@{c}" for c in CHECKPOINT_CHOICES])
        raise ValueError(f"{spec}: choose @latest, @best, @healthy or a step number{hint}")
    run, which = (Path(base), which) if asks_checkpoint else (Path(spec[3:]), "latest")
    if (asks_checkpoint or is_run_like(run)) and (not is_run_folder(run) or not list_checkpoints(run)):
        raise FileNotFoundError(_no_checkpoint(run, which))
    if not is_run_folder(run):
        if not run.exists() and _is_local_path(spec[3:]):
            raise FileNotFoundError(missing_folder(run))
        check_model(spec)
        return spec, None
    try:
        folder, why = pick_checkpoint(run, which)
    except FileNotFoundError as exc:  # none verifies, or none is known healthy: say what is there
        raise FileNotFoundError(f"{exc}; {run} holds: {folder_listing(run)}; checkpoints/ holds: "
                                f"{', '.join(sorted(p.name for p in (run / 'checkpoints').iterdir()))}") from exc
    return f"hf:{folder / 'actor'}", f"{spec} -> {why}"


_CHECKPOINT_ACTOR = re.compile(r"^(?P<run>.+)/checkpoints/step-\d+/actor/?$")


def agent_identity(spec: str) -> str:
    """Who an agent spec names, typed or resolved: every checkpoint of a training run is that run (``hf:RUN@best``,
    ``hf:RUN`` and ``hf:RUN/checkpoints/step-N/actor`` are one contestant, evaluated again as it trains); a local
    folder is its absolute path; anything else is the spec itself."""
    if not spec.startswith("hf:"):
        return spec
    path = spec[3:]
    match = _CHECKPOINT_ACTOR.match(path)
    if match:
        path = match["run"]
    else:
        base, sep, _ = path.rpartition("@")
        path = base if sep and not Path(path).expanduser().is_dir() else path
    folder = Path(path).expanduser()
    return f"hf:{folder.resolve()}" if folder.exists() else spec


def is_run_like(path: Path) -> bool:
    """A folder a training run wrote (even one stopped before its first checkpoint), not a model folder."""
    return path.is_dir() and not (path / "config.json").exists() and any(
        (path / name).exists() for name in ("checkpoints", "config.yaml", "metrics.jsonl"))


def _is_local_path(text: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else with a slash (or starting like a path) is a folder."""
    return text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text


def _no_checkpoint(run: Path, which: str) -> str:
    if not run.exists():
        return missing_folder(run)
    if not run.is_dir():
        return f"{run} is a file, not a run folder"
    if (run / "config.json").exists():
        return f"{run} is a model folder (config.json), not a training run: use hf:{run} without @{which}"
    checkpoints = run / "checkpoints"
    if checkpoints.is_dir():
        inside = sorted(p.name for p in checkpoints.iterdir())
        held = f"(checkpoints/ holds only {', '.join(inside)})" if inside else "(checkpoints/ is empty)"
        return f"{run} holds no checkpoint {held}, so there is no @{which}; it holds: {folder_listing(run)}"
    contents = folder_listing(run)
    held = f"it holds: {contents}" if contents else "it is empty"
    return (f"{run} holds no checkpoint; {held}. A run writes checkpoints/step-N every checkpoint.every iterations and "
            "at its end")


def folder_listing(folder: Path, limit: int = 12) -> str:
    entries = sorted(folder.iterdir())
    names = []
    for entry in entries[:limit]:
        if entry.name == "metrics.jsonl":
            records = sum(1 for line in entry.read_text(errors="replace").splitlines() if line.strip())
            names.append(f"metrics.jsonl ({records} record{'s' * (records != 1)})")
        else:
            names.append(entry.name + "/" * entry.is_dir())
    return ", ".join(names) + (f", ... ({len(entries) - limit} more)" if len(entries) > limit else "")


def missing_folder(path: Path) -> str:
    """``runs/tuor/toy does not exist; runs holds: tour (did you mean tour?)``."""
    existing, missing = path, None
    while not existing.exists() and existing != existing.parent:
        existing, missing = existing.parent, existing.name
    if not existing.is_dir() or missing is None:
        return f"{path} does not exist"
    names = sorted(p.name for p in existing.iterdir() if not p.name.startswith("."))
    shown = f"{existing} holds: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''}" if names \
        else f"{existing} is empty"
    return f"{path} does not exist; {shown}{did_you_mean(missing, names)}"


def _hf_agent(path: str, max_new_tokens: int, max_observation_tokens: int = DEFAULT_MAX_OBSERVATION_TOKENS) -> Agent:
    """One loaded model serves every benchmark of an evaluation; a checkpoint rewritten at the same path (a run
    trained again with --overwrite) is loaded afresh."""
    return _cached_hf_agent(path, max_new_tokens, _folder_stamp(path), max_observation_tokens)


def _folder_stamp(path: str) -> tuple:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return ()  # a model name (hf:smollm2): resolved to a cache that does not change under us
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file())


@functools.lru_cache(maxsize=2)
def _cached_hf_agent(path: str, max_new_tokens: int, stamp: tuple, max_observation_tokens: int) -> Agent:
    from stppo_agent.evaluation.hf_agent import HFAgent

    return HFAgent(path, max_new_tokens=max_new_tokens, max_observation_tokens=max_observation_tokens)


def build_agent(spec: str, examples: Sequence[Example], max_new_tokens: int = 256,
                max_observation_tokens: int | None = None) -> Agent:
    """An agent from its spec string; ``examples`` are given to agents that need them (the oracle).
    ``max_observation_tokens``: where an hf: agent cuts each observation (None: training's default); other agents
    read whole observations and refuse a cut they would not apply."""
    check_agent_spec(spec)
    if spec.startswith("hf:"):
        return _hf_agent(spec[3:], max_new_tokens, observation_budget(max_observation_tokens))
    if max_observation_tokens is not None:
        raise ValueError(f"agent {spec!r} reads whole observations; --max-observation-tokens "
                         f"{max_observation_tokens} applies to hf: agents only (an openai: server limits "
                         "observations by its own context length)")
    if spec in SCRIPTED_AGENTS:
        return SCRIPTED_AGENTS[spec](examples)
    from stppo_agent.evaluation.openai_agent import OpenAIChatAgent

    return OpenAIChatAgent.from_spec(spec[len("openai:"):], max_tokens=max_new_tokens)
