"""The README's walk-through runs as written: every command of its marked block, in order, exits 0."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from .cli_in_process import stppo

REPO = Path(__file__).resolve().parents[1]


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
        # script itself is run by tests/test_cli_docs.py)
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
