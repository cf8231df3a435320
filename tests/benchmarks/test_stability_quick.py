"""benchmarks/stability.py --quick: the study end to end on a tiny model, with real gradients (a few minutes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.processes import alive, descendants, gone_within, name


def test_stability_study_quick_mode_runs_every_part(tmp_path):
    out = tmp_path / "study"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "stability.py"), "--quick", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    # The exactness check means something only if the updates do: the recorded run was paid, every step had a
    # gradient, the weights moved between steps (off-policy ratios left 1) and some tokens were clipped.
    recorded = out / "live" / "ppo-s0"
    assert json.loads((recorded / "metrics.jsonl").read_text().splitlines()[0])["reward"] > 0
    steps = [json.loads(line) for line in (recorded / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 8 and all(step["grad_norm"] > 0 for step in steps)
    off_policy = [step for step in steps if not step["on_policy"]]
    assert max(step["ratio_max"] for step in off_policy) > 1.01
    assert max(step["token_outside_frac"] for step in off_policy) > 0
    assert summary["replays"]["ppo"]["clip_frac_max"] > 0
    assert summary["replays"]["ppo"]["ratio_max"] > summary["replays"]["ppo"]["turn_ratio_max"]  # turns of tokens
    assert summary["replays"]["st_ppo"]["clip_bias_scale_mean"] is not None
    assert summary["replay_reproduces_recording"] is True
    assert set(summary["replays"]) == {"ppo", "turn_ppo", "s_ppo", "st_ppo"}
    assert set(summary["live"]) == {"ppo", "st_ppo"} and set(summary["before"]) == {"general", "multi-hop", "medical"}
    for algo, seeds in summary["live"].items():
        assert set(seeds["0"]["after"]) == {"general", "multi-hop", "medical"}, algo
    # every replay wrote per-step diagnostics: 4 mini-batches x 2 epochs
    for rule in ("turn_ppo", "s_ppo", "st_ppo"):
        steps = (out / "replay" / rule / "steps.jsonl").read_text().splitlines()
        assert len(steps) == 8 and json.loads(steps[0])["on_policy"] is True
    report = (out / "report.md").read_text()
    assert "reproduces the recorded run's update metrics exactly: **yes**" in report
    assert "| st_ppo |" in report and "Collapse criterion" in report
    assert {p.name for p in (out / "figures" / "replay").iterdir()} >= {"reward.png", "clipping.png"}
    assert (out / "figures" / "replay" / "steps.png").exists()
    assert summary["complete"] is True and "Incomplete" not in report
    # weights are dropped once a run is evaluated or replayed (28 GB over the default study); the recording stays
    assert not list(out.glob("*/*/checkpoints")), list(out.glob("*/*/checkpoints"))
    assert (out / "live" / "ppo-s0" / "rollouts" / "initial" / "actor").is_dir()

    # --report-only runs nothing and never clears a run another invocation may be writing: here the st_ppo run
    # lost its done marker (as while it trains), so it is left as it is and missing from the tables
    (out / "live" / "st_ppo-s0" / "done").unlink()
    before = sorted(p.name for p in (out / "live" / "st_ppo-s0").iterdir())
    again = subprocess.run([sys.executable, str(REPO / "benchmarks" / "stability.py"), "--quick", "--out", str(out),
                            "--report-only"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in (out / "live" / "st_ppo-s0").iterdir()) == before
    partial = json.loads((out / "summary.json").read_text())
    assert set(partial["live"]) == {"ppo"} and partial["complete"] is False
    assert set(partial["replays"]) == {"ppo", "turn_ppo", "s_ppo", "st_ppo"}
    assert "Incomplete" in (out / "report.md").read_text()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from Linux /proc")
def test_kill_stops_the_study_and_the_command_it_waits_for(tmp_path):
    """The study's commands run forked from a fork server (benchmarks/stppo_commands.py): SIGTERM to the study must
    kill the running `stppo` command at once and leave no process of the study behind (fork server included)."""
    study = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "stability.py"), "--quick", "--out",
                              str(tmp_path / "study")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 300
        command = []
        while not command and time.monotonic() < deadline:  # the first `stppo` command starts
            time.sleep(0.2)
            tree = descendants(study.pid)
            command = [pid for pid in tree if name(pid).startswith("stppo ")]
        assert command, f"the study never started a stppo command: {[name(pid) for pid in tree]}"
        os.kill(study.pid, signal.SIGTERM)
        assert gone_within(command[0], 10), "the stppo command ran on after the study was stopped"
        study.wait(timeout=60)
        assert study.returncode == 128 + signal.SIGTERM
        assert [pid for pid in tree if not gone_within(pid, 30)] == [], "a process of the study outlived it"
    finally:
        study.kill()
        for pid in tree:  # never leave a stray process behind, even when the test fails
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
