"""benchmarks/stress_levels.py and stress_readout.py: a level's exact options from the run's actual batch, the
step-matched controls, learning rates that move only when a level says so, options this stppo lacks refused, and
read-outs aligned by policy version."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import stress  # noqa: E402
import stress_levels as levels  # noqa: E402
from stress_readout import readouts, run_readout  # noqa: E402

KNOWN = levels.known_levels()


def plan(name, extra=(), versions=10, tier=stress.TOY, table=KNOWN):
    return levels.plan(tier, table, name, [*tier.common, *extra], versions)


def test_a_lag_level_trains_n_plus_k_iterations_at_one_step_each():
    lag16 = plan("lag16")
    assert lag16.iterations == 26 and lag16.staleness == 16 and lag16.steps_per_iteration == 1
    assert lag16.sets == ["optimizer.epochs=1", "rollout.prompts_per_iteration=8", "optimizer.mini_batch_size=32",
                          "optimizer.micro_batch_size=16",
                          "optimizer.actor_lr=0.003", "optimizer.critic_lr=0.003", "rollout.staleness=16",
                          "monitor.probe_every=4"]
    assert plan("lag0").sets == [s.replace("16", "0") if s.startswith("rollout") else s for s in lag16.sets]


def test_mini_batches_split_the_runs_actual_batch_not_a_tier_constant():
    # 4 prompts x 4 samples = 16 trajectories: 4 mini-batches are 4 trajectories each (a constant 32 made 8)
    reuse = plan("reuse4x4", ["rollout.prompts_per_iteration=4"])
    assert "optimizer.mini_batch_size=4" in reuse.sets and "optimizer.micro_batch_size=4" in reuse.sets
    assert reuse.steps_per_iteration == 16
    with pytest.raises(SystemExit, match="mini_batches=4 does not divide the run's batch of 15"):
        plan("reuse4x4", ["rollout.prompts_per_iteration=5", "rollout.samples_per_prompt=3"])


def test_the_step_matched_control_takes_the_same_steps_on_the_same_mini_batch_size_each_on_fresh_rollouts():
    reuse, control = plan("reuse2x4"), plan("steps8")
    assert reuse.steps_per_iteration == 8 and reuse.versions == control.versions == 40 and reuse.iterations == 40
    assert "optimizer.mini_batch_size=8" in reuse.sets and "optimizer.mini_batch_size=8" in control.sets
    assert "rollout.prompts_per_iteration=2" in control.sets and control.steps_per_iteration == 1
    assert control.iterations == 320 and control.scale == 8  # 8x the iterations, one step on 8 fresh trajectories
    # probes at the same step counts
    assert "monitor.probe_every=8" in control.sets and "monitor.probe_every=1" in reuse.sets
    quick_reuse, quick_control = plan("reuse2x2", versions=3), plan("steps4", versions=3)
    assert (quick_reuse.iterations, quick_control.iterations) == (3, 12)  # no versions knob: the grid's N
    assert "monitor.probe_every=4" in quick_reuse.sets and "monitor.probe_every=16" in quick_control.sets
    with pytest.raises(SystemExit, match="rollout.prompts_per_iteration=6 does not split into its 4 mini-batches"):
        plan("steps8", ["rollout.prompts_per_iteration=6"])


def test_the_critic_lr_moves_with_the_actor_only_when_the_level_says_so():
    table = dict(KNOWN)
    table["hot"] = {**levels.BASE, "lr_scale": 10}
    table["hot_both"] = {**levels.BASE, "lr_scale": 10, "critic_lr_scale": 10}
    hot, both = plan("hot", table=table), plan("hot_both", table=table)
    assert (hot.actor_lr, hot.critic_lr) == pytest.approx((0.03, 0.003))
    assert (both.actor_lr, both.critic_lr) == pytest.approx((0.03, 0.03))
    assert "optimizer.critic_lr=0.003" in hot.sets and "optimizer.critic_lr=0.03" in both.sets


def test_parse_level_keeps_unnamed_knobs_and_reads_values_as_yaml():
    name, knobs = levels.parse_level("lag8:rollout.staleness=8,control=lag0,algorithm.clip_high=0.28")
    assert name == "lag8" and knobs == {**levels.BASE, "rollout.staleness": 8, "control": "lag0",
                                        "algorithm.clip_high": 0.28}
    assert levels.parse_level("lag16:lr_scale=2")[1]["rollout.staleness"] == 16
    with pytest.raises(SystemExit, match="is not knob=value"):
        levels.parse_level("x:rollout.staleness")


def test_options_this_stppo_lacks_are_named():
    assert levels.missing_options(["rollout.staleness=1", "algorithm.clip_high=0.3", "no_such_option=1",
                                   "algorithm.no_such_field=2"]) == ["no_such_option", "algorithm.no_such_field"]
    assert levels.has_option("monitor.probe_every") and not levels.has_option("no_such_option")
    assert not levels.has_option("probe_every")  # a flat name of earlier versions


def test_old_levels_stay_runnable_by_name_but_off_the_default_ladder():
    assert {"none", "mild", "strong", "stale", "extreme", "lr_only"} <= set(KNOWN)
    assert not {"strong", "extreme", "lr_only"} & set(levels.DEFAULT_LEVELS)
    assert all(KNOWN[name]["lr_scale"] == 1 and KNOWN[name]["critic_lr_scale"] == 1 for name in levels.LADDER)


def records(n, staleness=0, probes=()):
    out = [{"step": i + 1, "reward": 0.01 * (i + 1), "invalid_action_rate": 0.0, "grad_norm": 1.0} for i in range(n)]
    for step, version, reward in probes:
        out[step - 1].update({"probe/reward": reward, "probe/invalid_action_rate": 0.0,
                              "probe/policy_version": version})
    return out


def test_rollout_read_outs_of_a_k_lag_run_are_iterations_k_to_k_plus_n_minus_one():
    series = readouts(records(13, 3), staleness=3, scale=1, steps_per_iteration=1, versions=10, counts_invalid=False)
    assert series["source"] == "rollouts" and series["invalid"] is None
    assert series["rewards"] == pytest.approx([0.01 * s for s in range(4, 14)])  # steps 4..13 = iterations 3..12
    assert series["labels"] == [float(v) for v in range(10)]


def test_a_step_matched_controls_read_outs_sit_at_its_reuse_levels_step_counts():
    series = readouts(records(24), staleness=0, scale=8, steps_per_iteration=1, versions=3, counts_invalid=True)
    assert series["rewards"] == pytest.approx([0.01, 0.09, 0.17]) and series["labels"] == [0.0, 8.0, 16.0]
    reuse = readouts(records(3), staleness=0, scale=1, steps_per_iteration=8, versions=3, counts_invalid=True)
    assert reuse["labels"] == [0.0, 8.0, 16.0]


def test_probe_read_outs_win_and_stop_at_the_controls_last_version():
    recs = records(6, 2, probes=[(2, 2, 0.5), (4, 4, 0.6), (6, 6, 0.7)])
    series = readouts(recs, staleness=2, scale=1, steps_per_iteration=1, versions=4, counts_invalid=True)
    assert series["source"] == "probe" and series["labels"] == [2.0, 4.0] and series["rewards"] == [0.5, 0.6]


def test_precursors_count_grad_norm_spikes_over_the_aligned_updates_only():
    recs = records(14)
    for r, norm in zip(recs, [1.0, 1.2, 0.9, 15.0, 1.1, 1.0, 1.0, 1.0, 1.0, 50.0, 1.0, 1.0, 1.0, 99.0]):
        r["grad_norm"] = norm
    summary = run_readout(recs, staleness=4, scale=1, steps_per_iteration=1, versions=10, counts_invalid=False)
    assert summary["grad_norm_spikes"] == 2 and summary["grad_norm_max"] == 50.0  # the 14th is a version past 10
    assert summary["first_batch"] == [0.01, None] and summary["readouts"] == 10
