"""benchmarks/stress.py: the Wilson interval, the levels, the default rules, and --quick end to end with a plugin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import stress  # noqa: E402

PLUGIN = """
import dataclasses
from stppo_agent.algorithms import ALGORITHMS, register_algorithm

register_algorithm(dataclasses.replace(ALGORITHMS["ppo"], name="narrow_ppo", clip_low=0.05, clip_high=0.05))
"""


@pytest.mark.parametrize("k,n,low,high", [(0, 5, 0.0, 0.4345), (5, 5, 0.5655, 1.0), (3, 6, 0.1876, 0.8124),
                                          (0, 1, 0.0, 0.7935), (1, 1, 0.2065, 1.0), (1, 10, 0.0179, 0.4042)])
def test_wilson_interval_matches_the_closed_form(k, n, low, high):
    got = stress.wilson(k, n)
    assert got == pytest.approx((low, high), abs=5e-5)


def test_levels_resolve_to_training_options_and_extra_knobs_pass_through():
    name, knobs = stress.parse_level("stale4:rollout_staleness=4,mini_batches=4")
    assert name == "stale4" and knobs == {"ppo_epochs": 1, "mini_batches": 4, "lr_scale": 1, "rollout_staleness": 4}
    sets = stress.level_overrides(stress.TOY, knobs)
    assert sets == ["ppo_epochs=1", "mini_batch_size=8", "micro_batch_size=8", "actor_lr=0.003", "rollout_staleness=4"]
    assert stress.level_overrides(stress.TOY, stress.LADDER["extreme"])[:4] == [
        "ppo_epochs=4", "mini_batch_size=8", "micro_batch_size=8", "actor_lr=0.3"]
    with pytest.raises(SystemExit, match="does not divide"):
        stress.level_overrides(stress.TOY, {"ppo_epochs": 1, "mini_batches": 5, "lr_scale": 1})


def test_default_rules_are_the_core_seven_then_every_registered_preset(tmp_path):
    from stppo_agent.algorithms import ALGORITHMS

    rules = stress.resolve_rules(stress.parse_args(["--out", str(tmp_path)]))
    assert rules[:7] == ["ppo", "turn_ppo", "s_ppo", "st_ppo", "grpo", "gspo", "so_grpo"]
    assert set(rules) == set(ALGORITHMS) and len(rules) == len(set(rules))
    with pytest.raises(SystemExit, match="did you mean st_ppo"):
        stress.resolve_rules(stress.parse_args(["--out", str(tmp_path), "--rules", "st_ppoo"]))


def run_stress(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "stress.py"), *args], capture_output=True,
                          text=True, timeout=600)


def test_quick_grid_ranks_a_plugin_rule_resumes_and_reports(tmp_path):
    plugin = tmp_path / "narrow.py"
    plugin.write_text(PLUGIN)
    out = tmp_path / "grid"
    result = run_stress("--quick", "--out", str(out), "--import", str(plugin), "--rules", "ppo,narrow_ppo")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quick"] is True and summary["tier"] == "toy" and summary["complete"] is True
    assert summary["levels_order"] == ["none", "extreme"] and summary["rules"] == ["ppo", "narrow_ppo"]
    for level in ("none", "extreme"):
        for rule in ("ppo", "narrow_ppo"):
            cell = summary["cells"][level][rule]
            assert cell["n"] == 1 and cell["seeds"] == [0]
            assert cell["wilson95"] == pytest.approx(stress.wilson(cell["collapsed"], 1))
            assert cell["reward_last_mean"] is not None and cell["clip_frac_mean"] is not None
            run = out / "runs" / level / rule / "s0"
            assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    # the plugin's rule really ran with its own clip range, recorded for --resume / replay
    config = (out / "runs" / "extreme" / "narrow_ppo" / "s0" / "config.yaml").read_text()
    assert "clip_low: 0.05" in config and str(plugin) in config
    # the extreme level is off-policy: 16 optimizer steps per iteration clip tokens; none (one step) cannot
    assert summary["cells"]["extreme"]["ppo"]["clip_frac_mean"] > 0
    assert summary["cells"]["none"]["ppo"]["clip_frac_mean"] == 0
    report = (out / "report.md").read_text()
    assert "tier toy (--quick: plumbing" in report and stress.COLLAPSE in report
    assert "| toy | extreme | narrow_ppo | 1 |" in report
    assert ("[0.00, 0.79]" in report) or ("[0.21, 1.00]" in report)
    assert "ppo_epochs=4 mini_batch_size=8 micro_batch_size=8 actor_lr=0.3" in report
    assert (out / "figures" / "stress-collapse.png").stat().st_size > 0

    # a rerun finds every run done and trains nothing
    walls = {p: json.loads(p.read_text())["wall_s"] for p in out.glob("runs/*/*/s0/stress.json")}
    again = run_stress("--quick", "--out", str(out), "--import", str(plugin), "--rules", "ppo,narrow_ppo")
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p: json.loads(p.read_text())["wall_s"] for p in out.glob("runs/*/*/s0/stress.json")} == walls
    # other options for the same folder are refused, not mixed in
    other = run_stress("--quick", "--out", str(out), "--import", str(plugin), "--rules", "ppo",
                       "--set", "critic_lr=1e-2")
    assert other.returncode != 0 and "use another --out" in other.stderr
    # --report-only leaves a run without its done marker (as while it trains) alone and marks the grid incomplete
    (out / "runs" / "extreme" / "ppo" / "s0" / "done").unlink()
    partial = run_stress("--quick", "--out", str(out), "--import", str(plugin), "--rules", "ppo,narrow_ppo",
                         "--report-only")
    assert partial.returncode == 0, partial.stderr[-3000:]
    assert (out / "runs" / "extreme" / "ppo" / "s0" / "metrics.jsonl").exists()
    cut = json.loads((out / "summary.json").read_text())
    assert cut["complete"] is False and "ppo" not in cut["cells"]["extreme"]
    assert "Incomplete" in (out / "report.md").read_text()


NEW_RULES = ("cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "m2po", "dr_grpo", "dapo", "turn_gae")


def test_every_stabilizer_of_issue_25_runs_in_the_quick_grid(tmp_path):
    out = tmp_path / "new"
    result = run_stress("--quick", "--out", str(out), "--rules", ",".join(NEW_RULES), "--levels", "extreme",
                        "--iterations", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is True and summary["rules"] == list(NEW_RULES)
    for rule in NEW_RULES:
        cell = summary["cells"]["extreme"][rule]
        assert cell["n"] == 1 and cell["reward_last_mean"] is not None, rule
        config = (out / "runs" / "extreme" / rule / "s0" / "config.yaml").read_text()
        assert f"algo: {rule}" in config
