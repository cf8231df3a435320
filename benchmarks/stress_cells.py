"""The stress grid's cells (rule x level) from their runs, and the comparisons the report prints: each cell against
its level's matched control (same rule), and each rule against the reference rule (the first of --rules) within
a level. Seeds pair when both runs of every common seed drew the same first batch (checked, not assumed: rules
whose presets build a critic and rules that do not consume the random stream differently); paired cells get the
exact McNemar test, others Fisher's (benchmarks/stress_stats.py). A run's final reward (the mean of its last
FINAL_READOUTS read-outs) is compared the same two ways: Wilcoxon signed-rank on paired seeds, else Mann-Whitney."""

from __future__ import annotations

import statistics

from stress_stats import compare, compare_values, detectable_difference, wilson

MEANS = ("reward_first", "reward_last", "entropy_last", "grad_norm_max", "grad_norm_p99", "grad_norm_spikes",
         "ratio_p99_mean", "turn_ratio_max", "ess_min", "kl_to_reference_last", "learner_kl_to_reference_last",
         "clip_frac_mean", "turn_clip_frac_mean", "clip_bias_changed_share", "clip_bias_scale_mean",
         "probe_entropy_last", "collapse_line_last", "wall_s")
MEDIANS = ("ratio_max", "clip_bias_norm_median")
FINAL_READOUTS = 5  # a single probe of 16 prompts moves by 1/16 per answer: the final reward averages a few


def final_reward(run: dict) -> float | None:
    """The mean of a run's last FINAL_READOUTS read-out rewards (None without read-outs)."""
    curve = [r for r in run.get("reward_curve") or [] if r is not None][-FINAL_READOUTS:]
    return statistics.fmean(curve) if curve else None


def cell_summary(runs: dict[int, dict]) -> dict:
    """Per (rule, level): collapses (persistent) and dips counted apart, the rate's Wilson interval, means and
    medians of the runs' figures over seeds."""
    n = len(runs)
    collapsed = {seed: r["collapsed_at"] for seed, r in runs.items() if r["collapsed"]}
    dipped = sorted(seed for seed, r in runs.items() if r["dipped"])
    low, high = wilson(len(collapsed), n)

    def over(key, how):
        values = [r[key] for r in runs.values() if r.get(key) is not None]
        return how(values) if values else None

    cell = {"seeds": sorted(runs), "n": n, "collapsed": len(collapsed), "rate": len(collapsed) / n if n else None,
            "wilson95": [low, high], "collapsed_at": collapsed, "dipped": len(dipped), "dipped_seeds": dipped,
            "median_collapse_version": statistics.median(collapsed.values()) if collapsed else None,
            "readout_source": sorted({r["readout_source"] for r in runs.values()})}
    cell.update({f"{key}_mean": over(key, statistics.fmean) for key in MEANS})
    cell.update({f"{key}_median": over(key, statistics.median) for key in MEDIANS})
    finals = [f for f in map(final_reward, runs.values()) if f is not None]
    cell["final_reward_mean"] = statistics.fmean(finals) if finals else None
    cell["final_reward_sd"] = statistics.stdev(finals) if len(finals) > 1 else None
    return cell


def paired(first: dict[int, dict], second: dict[int, dict]) -> bool:
    """Whether the two cells' runs of every seed they share drew the same first batch (same reward and length)."""
    common = set(first) & set(second)
    return bool(common) and all(first[s]["first_batch"] == second[s]["first_batch"] for s in common)


def tested_against(first: dict[int, dict], second: dict[int, dict]) -> dict:
    result = compare({s: r["collapsed"] for s, r in first.items()}, {s: r["collapsed"] for s, r in second.items()},
                     paired(first, second))
    result["paired"] = result["test"] == "mcnemar"
    finals = [{s: final_reward(r) for s, r in cell.items() if final_reward(r) is not None} for cell in (first, second)]
    result["final_reward"] = compare_values(*finals, result["paired"])
    return result


def comparisons(runs: dict[str, dict[str, dict[int, dict]]], levels: dict[str, dict], order: list[str],
                rules: list[str]) -> dict:
    """``against_control[level][rule]`` and ``against_reference[level][rule]``, each with its test and p-value,
    and ``detectable[level][rule]``: the smallest rise of the collapse rate over the control's this cell's n
    detects (a control cell: against another arm of its own size and rate)."""
    out = {"reference_rule": rules[0] if rules else None, "against_control": {}, "against_reference": {},
           "detectable": {}}
    for level in order:
        control = levels[level].get("control")
        for rule, cell in runs.get(level, {}).items():
            base = runs.get(control, {}).get(rule) if control else None
            if base:
                out["against_control"].setdefault(level, {})[rule] = {"control": control, **tested_against(cell, base)}
            reference = base if base else cell
            rate = sum(r["collapsed"] for r in reference.values()) / len(reference)
            out["detectable"].setdefault(level, {})[rule] = detectable_difference(len(cell), len(reference), rate)
            if rules and rule != rules[0] and rules[0] in runs.get(level, {}):
                out["against_reference"].setdefault(level, {})[rule] = tested_against(cell, runs[level][rules[0]])
    return out
