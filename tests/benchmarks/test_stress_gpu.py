"""benchmarks/stress_gpu.py: the PASS/FAIL rule (clip fraction and ratio tails grow with the lag), the GPU-hours
fit from timed runs, and the check end to end on a CPU with a tiny copy model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import stress_gpu  # noqa: E402


def summary_with(rows: dict[int, dict]) -> dict:
    return {"runs": {f"lag{k}": {"ppo": {"0": row}} for k, row in rows.items()}}


def test_pass_needs_every_tail_to_grow_with_the_lag():
    grows = {0: {"clip_frac_mean": 0.0, "ratio_p99_mean": 1.0, "ratio_max": 1.0},
             16: {"clip_frac_mean": 0.02, "ratio_p99_mean": 1.1, "ratio_max": 2.0},
             64: {"clip_frac_mean": 0.05, "ratio_p99_mean": 1.3, "ratio_max": 2.0}}  # a plateau is allowed
    ok, rows = stress_gpu.growth(summary_with(grows), [0, 16, 64])
    assert ok and [r["lag"] for r in rows] == [0, 16, 64]
    shrinks = {**grows, 64: {**grows[64], "ratio_p99_mean": 1.05}}
    assert not stress_gpu.growth(summary_with(shrinks), [0, 16, 64])[0]
    flat = {k: {**row, "clip_frac_mean": 0.0} for k, row in grows.items()}  # the lag never reaches the clip
    assert not stress_gpu.growth(summary_with(flat), [0, 16, 64])[0]


def test_the_timing_fit_separates_start_up_from_iterations_and_scales_to_the_grid():
    runs = {"lag0": 30, "lag16": 46, "lag64": 94}
    summary = {"plans": {lv: {"iterations": n} for lv, n in runs.items()},
               "runs": {lv: {"ppo": {"0": {"wall_s": 40 + 2.0 * n}}} for lv, n in runs.items()}}
    start, per_iteration = stress_gpu.timing(summary)
    assert start == pytest.approx(40) and per_iteration == pytest.approx(2.0)
    # 10 seeds x 2 rules x 3 lags = 60 runs of 40 s; 10 x 2 x (200 + 216 + 264) iterations of 2 s
    assert stress_gpu.grid_hours(start, per_iteration, 10) == pytest.approx((60 * 40 + 20 * 680 * 2) / 3600)


def test_lags_off_the_ladder_are_defined_as_levels_against_lag0():
    assert stress_gpu.lag_levels([0, 16, 24]) == ["lag24:rollout.staleness=24,control=lag0"]


def test_check_runs_end_to_end_on_a_cpu_and_prints_one_verdict(tmp_path):
    from stppo_agent.models.tiny import build_copy_llama

    model = build_copy_llama(tmp_path / "model")
    out = tmp_path / "check"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "stress_gpu.py"), "check", "--device", "cpu",
                             "--quick", "--model", str(model), "--lags", "0,2", "--iterations", "2", "--out",
                             str(out), "--", "--set", "rollout.max_new_tokens_per_turn=16", "--set",
                             "precision.autocast_dtype=null",
                             "--warm-start-lr", "1e-3"],
                            capture_output=True, text=True, timeout=900)
    verdicts = [line for line in result.stdout.splitlines() if line.startswith(("PASS:", "FAIL:"))]
    assert len(verdicts) == 1, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    ok, _ = stress_gpu.growth(summary, [0, 2])
    assert verdicts[0].startswith("PASS" if ok else "FAIL") and result.returncode == (0 if ok else 1)
    assert summary["tier"] == "gpu" and summary["levels_order"] == ["lag0", "lag2"]
    assert "GPU-hours" in result.stdout
