"""The README's walk-through runs as written: every command of its marked block, in order, exits 0. The README
stays a front door, and every link of it and of the docs pages it sends a reader to resolves."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from tests.support.cli_in_process import stppo
from tests.support.paths import REPO


def walkthrough_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- walk-through -->", 1)[1].split("<!-- /walk-through -->", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip().startswith("stppo ")]


def test_the_readme_walkthrough_runs_as_written(tmp_path, capsys, monkeypatch):
    commands = walkthrough_commands()
    assert len(commands) >= 6 and {c.split()[1] for c in commands} >= {"index", "eval", "compare", "train", "plot"}
    monkeypatch.chdir(REPO)  # where the README's reader runs them
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    outputs = []
    for command in commands:
        # as written, except that its outputs go to a scratch folder instead of the checkout's runs/tour; in this
        # process through the CLI's entry point (seven new processes cost ~40 s of imports; the `stppo` console
        # script itself is run by tests/docs/test_commands_in_docs.py)
        argv = [arg.replace("runs/tour", str(tmp_path)) for arg in shlex.split(command)[1:]]
        done = stppo(*argv, capsys=capsys)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
    copy = json.loads((tmp_path / "copy" / "results.json").read_text())
    oracle = json.loads((tmp_path / "oracle" / "results.json").read_text())
    assert [r["metrics"]["em" if "em" in r["metrics"] else "acc"] for r in oracle] == [1.0, 1.0, 1.0]
    header = outputs[3].splitlines()[0].split()
    assert len(copy) == 3 and header[-2:] == ["copy", "oracle"]  # compare printed both columns, refused nothing
    assert (tmp_path / "toy" / "checkpoints" / "step-5" / "manifest.json").exists()
    rewards = [json.loads(line)["reward"] for line in (tmp_path / "toy" / "metrics.jsonl").read_text().splitlines()]
    assert rewards[-1] > rewards[0] + 0.3, rewards  # the walk-through shows the reward moving
    trained = outputs[4].splitlines()
    summary = trained[next(i for i, line in enumerate(trained) if line.startswith("trained ")):]
    assert len(summary) <= 10 and f"{rewards[0]:.3f} (iteration 1) -> best" in summary[1], outputs[4]
    assert "no learning signal" not in outputs[4]
    assert (tmp_path / "plots" / "reward.png").exists()
    trained = json.loads((tmp_path / "trained" / "results.json").read_text())
    assert trained[0]["provenance"]["agent"].endswith("step-5/actor")  # @latest named the checkpoint it used


# The README is the front door; the pages it sends a reader to hold the reference.
FRONT_DOOR_PAGES = ["README.md", "docs/demo.md", "docs/envs.md", "docs/training.md", "docs/evaluation.md",
                    "docs/retrieval.md", "docs/measurements.md", "docs/development.md"]
WORK_LOG = re.compile(r"::test_|\b[Ss]ession \d|\b[Ii]ssue \d|load average")


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move detail to a docs page"
    text = "\n".join(lines)
    for needed in ("make demo", "make test", "stppo_envs", "stppo_agent", "<!-- walk-through -->"):
        assert needed in text


@pytest.mark.parametrize("page", FRONT_DOOR_PAGES)
def test_user_facing_pages_hold_no_work_log(page):
    found = [line for line in (REPO / page).read_text().splitlines() if WORK_LOG.search(line)]
    assert not found, f"{page}: pytest node ids, session or issue numbers or load averages: {found}"


@pytest.mark.parametrize("page", ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))])
def test_every_relative_link_resolves(page):
    source = REPO / page
    for target in re.findall(r"\]\(([^)\s]+)\)", source.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (source.parent / path).resolve() if path else source
        assert linked.exists(), f"{page}: {target} does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor in heading_anchors(linked.read_text()), f"{page}: no heading for #{anchor} in {path or page}"
