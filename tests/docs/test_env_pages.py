"""Every registered env is documented the Gymnasium way: its class docstring and docs/envs.md hold the sections
Gymnasium's own env pages have, name the id, and list its version."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import gymnasium
import pytest
from gymnasium.envs.registration import load_env_creator

import stppo_envs  # noqa: F401 (registers the ids)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "envs.md"
SECTIONS = ("Action Space", "Observation Space", "Rewards", "Starting State", "Episode End", "Information",
            "Arguments", "Version History")
IDS = sorted(env_id for env_id in gymnasium.registry if env_id.startswith("stppo/"))


def missing_sections(text: str, level: str) -> list[str]:
    return [name for name in SECTIONS if not re.search(rf"^\s*{level} {name}\s*$", text, re.MULTILINE)]


def page_section(env_id: str) -> str:
    """The part of docs/envs.md (one ``## `` heading to the next) that names ``env_id`` in its heading or table."""
    parts = re.split(r"^## ", PAGE.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]
    found = [part for part in parts if f"`{env_id}`" in part]
    assert len(found) == 1, f"docs/envs.md: {env_id} should be named in exactly one '## ' section, found {len(found)}"
    return found[0]


def test_the_registry_holds_the_package_ids():
    assert len(IDS) >= 13 and {"stppo/NQ-v0", "stppo/MedQA-v0", "stppo/SearchQA-v0", stppo_envs.TOY_ENV_ID} <= set(IDS)


@pytest.mark.parametrize("env_id", IDS)
def test_each_registered_id_has_a_gymnasium_style_docstring(env_id):
    spec = gymnasium.spec(env_id)
    doc = inspect.getdoc(load_env_creator(spec.entry_point)) or ""
    assert not missing_sections(doc, "##"), (
        f"{env_id}: the docstring of {spec.entry_point} lacks the sections {missing_sections(doc, '##')}")
    assert f"`{env_id}`" in doc, f"{env_id}: the docstring of {spec.entry_point} does not name the id"
    history = doc.split("## Version History", 1)[1]
    assert re.search(rf"^\s*- v{spec.version}:", history, re.MULTILINE), f"{env_id}: no v{spec.version} in its history"


@pytest.mark.parametrize("env_id", IDS)
def test_each_registered_id_is_documented_in_docs_envs(env_id):
    section = page_section(env_id)
    assert not missing_sections(section, "###"), (
        f"docs/envs.md: the section naming {env_id} lacks {missing_sections(section, '###')}")
    history = section.split("### Version History", 1)[1]
    assert re.search(rf"^- v{gymnasium.spec(env_id).version}:", history, re.MULTILINE)


def test_a_section_missing_is_found():
    doc = inspect.getdoc(stppo_envs.SearchQAEnv)
    assert missing_sections(doc, "##") == []
    assert missing_sections(doc.replace("## Episode End", "## Episode end"), "##") == ["Episode End"]
    assert missing_sections(doc.replace("## Rewards", "Rewards"), "##") == ["Rewards"]
