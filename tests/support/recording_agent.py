"""A plugin agent that leaves a mark when it is built, for tests that a command refuses bad input before any episode
is played (`--import` the file, then `--agent` / `--teacher` the name)."""

from __future__ import annotations

from pathlib import Path

SOURCE = '''
from pathlib import Path

from stppo_agent.evaluation.agent_specs import register_agent
from stppo_agent.evaluation.agents import {wraps}


def build(examples):
    Path(__file__).with_suffix(".built").write_text("built")
    return {wraps}(examples)


register_agent({name!r}, build)
'''


def recording_agent(folder: Path, name: str, wraps: str) -> Path:
    """Write a plugin registering agent ``name`` (the scripted agent class ``wraps`` of stppo_agent.evaluation.agents,
    built from the examples) into ``folder``; its file name carries the folder's, as the plugin loader refuses one
    module name from two paths in one process."""
    plugin = folder / f"{name.replace('-', '_')}_{folder.name}.py"
    plugin.write_text(SOURCE.format(name=name, wraps=wraps))
    return plugin


def was_built(plugin: Path) -> bool:
    return plugin.with_suffix(".built").exists()
