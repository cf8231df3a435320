"""benchmarks/stress.py's report: the markdown tables and the figure, from the summary dict it writes."""

from __future__ import annotations

import os
from pathlib import Path

from stability_report import fmt, table


def plot(summary: dict, path: Path) -> str:
    """Two panels against stress level, one line per rule (rules side by side): the persistent collapse rate with
    its 95% Wilson interval, and the final reward (mean over seeds, +- one sd): a grid where nothing collapses
    still shows what the stress cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels, rules = summary["levels_order"], summary["rules"]
    fig, (rates, finals) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, rule in enumerate(rules):
        xs, ys, errs, rewards, spreads = [], [], [[], []], [], []
        for j, level in enumerate(levels):
            cell = summary["cells"].get(level, {}).get(rule)
            if cell and cell["n"]:
                xs.append(j + (i - (len(rules) - 1) / 2) * 0.06)
                ys.append(cell["rate"])
                errs[0].append(max(0.0, cell["rate"] - cell["wilson95"][0]))  # rounding at 0/n and n/n
                errs[1].append(max(0.0, cell["wilson95"][1] - cell["rate"]))
                rewards.append(cell.get("final_reward_mean"))
                spreads.append(cell.get("final_reward_sd") or 0.0)
        if xs:
            rates.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=rule)
            if None not in rewards:
                finals.errorbar(xs, rewards, yerr=spreads, marker="o", capsize=3, label=rule)
    for ax in (rates, finals):
        ax.set_xticks(range(len(levels)), levels)
        ax.set_xlabel("stress level")
    rates.set_ylim(-0.05, 1.05)
    rates.set_ylabel("persistent collapse rate (95% Wilson)")
    finals.set_ylabel("final reward (last 5 read-outs; mean, sd)")
    seeds = sorted({c["n"] for lv in summary["cells"].values() for c in lv.values()})
    fig.suptitle(f"tier {summary['tier']}{' (--quick)' if summary['quick'] else ''}: seeds per cell {seeds}")
    rates.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def comparison_text(result: dict | None) -> str:
    if not result:
        return "-"
    if result["test"] == "mcnemar":
        return f"McNemar {result['only_first']}-{result['only_second']} of {result['pairs']} pairs, p={result['p']:.3g}"
    return f"Fisher {result['first'][0]}/{result['first'][1]} vs {result['second'][0]}/{result['second'][1]}, " \
           f"p={result['p']:.3g} (not paired)"


def cells_in_order(summary: dict):
    """(level, rule, cell, its comparison against the matched control, against the reference rule) for every
    cell the grid has, levels in the grid's order and rules in --rules order."""
    stats = summary["comparisons"]
    for level in summary["levels_order"]:
        for rule in summary["rules"]:
            cell = summary["cells"].get(level, {}).get(rule)
            if cell:
                yield (level, rule, cell, stats["against_control"].get(level, {}).get(rule),
                       stats["against_reference"].get(level, {}).get(rule))


def collapse_rows(summary: dict) -> list[list]:
    rows = []
    for level, rule, c, control, reference in cells_in_order(summary):
        detectable = summary["comparisons"]["detectable"].get(level, {}).get(rule)
        rows.append([summary["tier"], level, rule, c["n"], f"{c['collapsed']}/{c['n']}",
                     f"{c['rate']:.2f} [{c['wilson95'][0]:.2f}, {c['wilson95'][1]:.2f}]", c["dipped"],
                     "-" if detectable is None else f"+{detectable:.2f}",
                     (f"{control['control']}: " + comparison_text(control)) if control else "-",
                     comparison_text(reference),
                     ", ".join(f"s{s}@{v:g}" for s, v in c["collapsed_at"].items()) or "-",
                     f"{fmt(c['reward_first_mean'])} -> {fmt(c['reward_last_mean'])}",
                     fmt(c.get("collapse_line_last_mean")), "/".join(c["readout_source"])])
    return rows


def reward_text(result: dict | None) -> str:
    """A final-reward comparison: the mean difference (this cell minus the other), the paired wins-losses, p."""
    final = (result or {}).get("final_reward")
    if not final:
        return "-"
    if final["test"] == "wilcoxon":
        return (f"{final['mean_difference']:+.3f}{interval_text(final)} ({final['wins']} up, {final['losses']} down "
                f"of {final['pairs']} pairs; Wilcoxon p={final['p']:.3g})")
    return f"{final['mean_difference']:+.3f}{interval_text(final)} (Mann-Whitney p={final['p']:.3g}, not paired)"


def interval_text(final: dict) -> str:
    interval = final.get("ci95")  # absent in summaries written before intervals were computed
    return f" [{interval[0]:+.3f}, {interval[1]:+.3f}]" if interval else ""


def reward_rows(summary: dict) -> list[list]:
    return [[level, rule, c["n"], f"{c['final_reward_mean']:.3f}", fmt(c.get("final_reward_sd")),
             (f"{control['control']}: " + reward_text(control)) if control else "-", reward_text(reference)]
            for level, rule, c, control, reference in cells_in_order(summary) if c.get("final_reward_mean") is not None]


def precursor_rows(summary: dict) -> list[list]:
    return [[level, rule, c["entropy_last_mean"], c["probe_entropy_last_mean"], c["grad_norm_max_mean"],
             c["grad_norm_p99_mean"], c["grad_norm_spikes_mean"], c["ratio_max_median"], c["ratio_p99_mean_mean"],
             c["turn_ratio_max_mean"], c["ess_min_mean"], c["kl_to_reference_last_mean"],
             c["learner_kl_to_reference_last_mean"], c["clip_frac_mean_mean"], c["turn_clip_frac_mean_mean"],
             c["clip_bias_changed_share_mean"], c["clip_bias_norm_median_median"]]
            for level, rule, c, _, _ in cells_in_order(summary)]


def render(summary: dict) -> str:
    quick = " (--quick: plumbing at tiny sizes; not a measurement)" if summary["quick"] else ""
    out = [f"## Stress grid, tier {summary['tier']}{quick}", "",
           f"Tier: {summary['tier_description']}"
           + (f"; every run changed by `--set {' --set '.join(summary['sets'])}`" if summary.get("sets") else "")
           + ".", "",
           f"Command: `{summary['command']}`", "",
           f"Warm start: `{summary['warm_start']}`; {summary['warm_start_note']}. {summary['versions']} "
           f"policy versions per run unless a level says otherwise, read out by the learner probe every "
           f"probe_every versions where the tier probes (the levels' options say how often); seeds "
           f"{summary['seeds']}.", "",
           *([f"Held-out score of the warm start: {summary['held_out_before']}.", ""] if summary["held_out_before"]
             else []),
           f"Collapse criterion (benchmarks/collapse_criterion.py, `CRITERION`): {summary['collapse_criterion']}.", "",
           "### Levels", "",
           table(["level", "knobs", "stppo train options of the level", "actor lr", "critic lr", "iterations",
                  "policy versions", "optimizer steps per iteration", "control"],
                 [[name, ", ".join(f"{k}={v}" for k, v in summary["levels"][name].items()),
                   " ".join(p["sets"]), f"{p['actor_lr']:g}", f"{p['critic_lr']:g}", p["iterations"], p["versions"],
                   p["steps_per_iteration"], summary["levels"][name].get("control", "-")]
                  for name, p in summary["plans"].items()]), "",
           f"Options of every run: `{' '.join(summary['common_sets'])}`.", "", "### Collapses", "",
           "Collapsed: persistent collapses (the criterion above); dipped: runs that fell below the line and came "
           "back, counted apart. Line at end: the reward a run would have had to fall below at its last read-out "
           "(0.5 x its running best); where it is at or under the tier's chance reward, a fall back to a random policy "
           "would not count. Detectable: the smallest rise of the collapse rate over the control's observed rate "
           "that this cell's seeds detect with 80% power (Fisher, alpha 0.05, exact). Versions are optimizer steps.",
           "",
           table(["tier", "level", "rule", "n", "collapsed", "rate [95% Wilson]", "dipped", "detectable",
                  "vs matched control", f"vs {summary['comparisons']['reference_rule']} (same level)",
                  "collapsed seeds @ version", "reward first -> last read-out (mean)", "line at end (mean)",
                  "read-outs"],
                 collapse_rows(summary)), "", "### Final reward", "",
           "A run's final reward: the mean of its last 5 read-outs (benchmarks/stress_cells.py, FINAL_READOUTS). "
           "Differences are this cell minus the other, on the seeds both ran (Wilcoxon signed-rank, two-sided, "
           "where seeds pair; Mann-Whitney U where they do not).", "",
           table(["level", "rule", "n", "final reward (mean)", "sd", "vs matched control",
                  f"vs {summary['comparisons']['reference_rule']} (same level)"], reward_rows(summary)), "",
           "### Precursors (means over seeds of each run's figure)", "",
           table(["level", "rule", "entropy last", "probe entropy last", "grad norm max", "grad norm p99",
                  "grad spikes (>10x median)", "token ratio max (median)", "ratio p99", "turn ratio max",
                  "ratio ESS min", "KL to ref last", "learner KL to ref last", "clip_frac", "turn_clip_frac",
                  "clip_bias_changed share", "||C|| median"], precursor_rows(summary)), ""]
    if summary.get("figure"):
        out += [f"Figure: {summary['figure']}", ""]
    t = summary["timing"]
    out += [f"Time: runs done so far took {t['runs_wall_s'] / 60:.1f} min of wall time in all ({t['runs']} runs, "
            f"median {t['run_median_s']:.0f} s, {fmt(t['iteration_median_s'])} s per iteration); this invocation "
            f"{t['invocation_s'] / 60:.1f} min; machine: {os.cpu_count()} CPUs, OMP_NUM_THREADS="
            f"{summary['omp_num_threads']}, {summary['jobs']} run(s) at a time, load average {t['load_start']:.1f} "
            f"at start, {t['load_end']:.1f} at end."
            + ("" if summary["complete"] else " **Incomplete: the grid is still running or was stopped.**"), ""]
    return "\n".join(out)
