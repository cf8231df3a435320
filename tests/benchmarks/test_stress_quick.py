"""benchmarks/stress.py: the default rules, refusals, and --quick end to end (the lag and reuse ladders, the probe's
version-aligned read-outs, paired seeds, resume, report) with a plugin rule, and on the copy tier."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.support.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import stress  # noqa: E402
from collapse_criterion import CRITERION  # noqa: E402
from stress_levels import has_option  # noqa: E402

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


def test_default_rules_are_ppo_and_st_ppo_core_and_all_name_more(tmp_path):
    from stppo_agent.algorithms import ALGORITHMS

    assert stress.resolve_rules(stress.parse_args(["--out", str(tmp_path)])) == ["ppo", "st_ppo"]
    core = stress.resolve_rules(stress.parse_args(["--out", str(tmp_path), "--rules", "core"]))
    assert core == ["ppo", "turn_ppo", "s_ppo", "st_ppo", "grpo", "so_grpo"]
    every = stress.resolve_rules(stress.parse_args(["--out", str(tmp_path), "--rules", "all"]))
    assert every[:6] == core and set(every) == set(ALGORITHMS) and len(every) == len(set(every))
    with pytest.raises(SystemExit, match="did you mean st_ppo"):
        stress.resolve_rules(stress.parse_args(["--out", str(tmp_path), "--rules", "st_ppoo"]))


def test_options_the_levels_own_are_refused_in_set():
    with pytest.raises(SystemExit, match="--set optimizer.actor_lr=0.1: levels set optimizer.epochs, "
                                         "optimizer.mini_batch_size"):
        stress.parse_args(["--set", "optimizer.actor_lr=0.1"])


def test_a_level_needing_an_option_this_stppo_lacks_is_refused_before_anything_runs(tmp_path):
    result = run_stress("--out", str(tmp_path), "--levels", "lag0,future", "--level",
                        "future:no_such_option=1,control=lag0")
    assert result.returncode != 0
    assert "level future needs the training option no_such_option, which this stppo does not have" in result.stderr
    assert not (tmp_path / "warm-start").exists()


def run_stress(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "stress.py"), *args], capture_output=True,
                          text=True, timeout=600)


def test_quick_grid_runs_the_lag_and_reuse_ladders_version_aligned_resumes_and_reports(tmp_path):
    plugin = tmp_path / "narrow.py"
    plugin.write_text(PLUGIN)
    out = tmp_path / "grid"
    result = run_stress("--quick", "--out", str(out), "--import", str(plugin), "--rules", "ppo,narrow_ppo")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quick"] is True and summary["tier"] == "toy" and summary["complete"] is True
    assert summary["levels_order"] == ["lag0", "lag2", "reuse2x2", "steps4"] and summary["versions"] == 3
    assert summary["collapse_criterion"] == CRITERION
    for level, iterations in (("lag0", 3), ("lag2", 5), ("reuse2x2", 3), ("steps4", 12)):
        for rule in ("ppo", "narrow_ppo"):
            cell = summary["cells"][level][rule]
            assert cell["n"] == 1 and cell["seeds"] == [0] and cell["readout_source"] == ["probe"]
            assert cell["wilson95"] == pytest.approx(stress.wilson(cell["collapsed"], 1))
            run = out / "runs" / level / rule / "s0"
            assert len((run / "metrics.jsonl").read_text().splitlines()) == iterations
            versions = summary["runs"][level][rule]["0"]["labels"]
            # read-outs at the same optimizer steps: one step an iteration (lag), 4 (reuse2x2), 1 on 16 (steps4)
            assert versions == {"lag0": [1, 2, 3], "lag2": [1, 2, 3], "reuse2x2": [4, 8, 12],
                                "steps4": [4, 8, 12]}[level]
    # the warm start saved its optimizer state, and every run starts from its actor
    warm = out / "warm-start" / "checkpoints" / "step-2"
    assert (warm / "trainer_state.pt").exists() and summary["warm_start"] == str(warm / "actor")
    config = yaml.safe_load((out / "runs" / "lag2" / "narrow_ppo" / "s0" / "config.yaml").read_text())
    assert config["model"] == str(warm / "actor") and config["optimizer"]["warmup_steps"] == 10
    assert config["algorithm"]["clip_low"] == 0.05 and str(plugin) in config["plugins"]
    assert config.get("init_from") == (str(warm) if has_option("init_from") else None)
    # a lag run and its control drew the same first batch (paired: McNemar); a reuse level and its step-matched
    # control did not (Fisher)
    assert summary["runs"]["lag2"]["ppo"]["0"]["first_batch"] == summary["runs"]["lag0"]["ppo"]["0"]["first_batch"]
    tests = summary["comparisons"]["against_control"]
    assert tests["lag2"]["ppo"]["test"] == "mcnemar" and tests["reuse2x2"]["ppo"]["test"] == "fisher"
    assert summary["comparisons"]["against_reference"]["lag2"]["narrow_ppo"]["test"] == "mcnemar"
    # staleness is off-policy at one step an iteration: the lagged ratios move, lag0's stay 1 (before the probe)
    assert summary["cells"]["lag2"]["ppo"]["ratio_max_median"] > 1.0
    assert summary["cells"]["lag0"]["ppo"]["ratio_max_median"] == pytest.approx(1.0)
    report = (out / "report.md").read_text()
    assert "tier toy (--quick: plumbing" in report and CRITERION in report
    assert "| toy | lag2 | narrow_ppo | 1 | 0/1 |" in report or "| toy | lag2 | narrow_ppo | 1 | 1/1 |" in report
    # steps4: half the prompts, 4x the probe interval
    assert "optimizer.epochs=1 rollout.prompts_per_iteration=4 optimizer.mini_batch_size=16 " \
           "optimizer.micro_batch_size=16 optimizer.actor_lr=0.003 optimizer.critic_lr=0.003 " \
           "monitor.probe_every=4" in report
    assert (out / "figures" / "stress-collapse.png").stat().st_size > 0
    # the selection's own copy, which a later --report-only over other levels leaves alone
    kept = sorted((out / "reports").glob("*.md"))
    assert [p.name for p in kept] == [f"{'+'.join(summary['levels_order'])}--{'+'.join(summary['rules'])}.md"]
    assert kept[0].read_text() == report

    # a rerun finds every run done and trains nothing
    walls = {p: json.loads(p.read_text())["wall_s"] for p in out.glob("runs/*/*/s0/stress.json")}
    again = run_stress("--quick", "--out", str(out), "--import", str(plugin), "--rules", "ppo,narrow_ppo")
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p: json.loads(p.read_text())["wall_s"] for p in out.glob("runs/*/*/s0/stress.json")} == walls
    # other options for the same folder are refused, not mixed in
    other = run_stress("--quick", "--out", str(out), "--import", str(plugin), "--rules", "ppo",
                       "--set", "monitor.probe_prompts=5")
    assert other.returncode != 0 and "use another --out" in other.stderr
    # --report-only leaves a run without its done marker (as while it trains) alone and marks the grid incomplete
    (out / "runs" / "lag2" / "ppo" / "s0" / "done").unlink()
    partial = run_stress("--quick", "--out", str(out), "--import", str(plugin), "--rules", "ppo,narrow_ppo",
                         "--report-only")
    assert partial.returncode == 0, partial.stderr[-3000:]
    assert (out / "runs" / "lag2" / "ppo" / "s0" / "metrics.jsonl").exists()
    cut = json.loads((out / "summary.json").read_text())
    assert cut["complete"] is False and "ppo" not in cut["cells"]["lag2"]
    assert "Incomplete" in (out / "report.md").read_text()


def test_quick_copy_tier_counts_invalid_actions_in_its_read_outs(tmp_path):
    out = tmp_path / "copy"
    result = run_stress("--quick", "--tier", "copy", "--out", str(out), "--rules", "ppo", "--levels", "lag0,lag2")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tier"] == "copy" and set(summary["cells"]) == {"lag0", "lag2"}
    run = summary["runs"]["lag2"]["ppo"]["0"]
    assert run["readout_source"] == "probe" and len(run["invalid_curve"]) == len(run["reward_curve"]) == 3
    assert json.loads((out / "model" / "warm_start.json").read_text())["sampled_accuracy"] >= 0.1
    records = [json.loads(line) for line in (out / "runs" / "lag2" / "ppo" / "s0" / "metrics.jsonl").open()]
    assert all(0 <= r["invalid_action_rate"] <= 1 for r in records) and len(records) == 5


NEW_RULES = ("cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "m2po", "dr_grpo", "dapo", "turn_gae")


def test_every_stabilizer_preset_runs_in_the_quick_grid(tmp_path):
    out = tmp_path / "new"
    result = run_stress("--quick", "--out", str(out), "--rules", ",".join(NEW_RULES), "--levels", "extreme",
                        "--iterations", "1")  # a level of the earlier grids, still runnable by name
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is True and summary["rules"] == list(NEW_RULES)
    for rule in NEW_RULES:
        cell = summary["cells"]["extreme"][rule]
        assert cell["n"] == 1 and cell["reward_last_mean"] is not None, rule
        config = (out / "runs" / "extreme" / rule / "s0" / "config.yaml").read_text()
        assert f"algo: {rule}" in config
