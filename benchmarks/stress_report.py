"""benchmarks/stress.py's report: the markdown tables and the figure, from the summary dict it writes."""

from __future__ import annotations

import os
from pathlib import Path

from stability_report import fmt, table


def plot(summary: dict, path: Path) -> str:
    """Collapse rate against stress level, one line per rule, 95% Wilson interval bars (rules side by side)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels, rules = summary["levels_order"], summary["rules"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, rule in enumerate(rules):
        xs, ys, errs = [], [], [[], []]
        for j, level in enumerate(levels):
            cell = summary["cells"].get(level, {}).get(rule)
            if cell and cell["n"]:
                xs.append(j + (i - (len(rules) - 1) / 2) * 0.06)
                ys.append(cell["rate"])
                errs[0].append(max(0.0, cell["rate"] - cell["wilson95"][0]))  # rounding at 0/n and n/n
                errs[1].append(max(0.0, cell["wilson95"][1] - cell["rate"]))
        if xs:
            ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=rule)
    ax.set_xticks(range(len(levels)), levels)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("stress level")
    ax.set_ylabel("collapse rate (95% Wilson interval)")
    seeds = sorted({n for lv in summary["cells"].values() for c in lv.values() for n in [c["n"]]})
    ax.set_title(f"tier {summary['tier']}{' (--quick)' if summary['quick'] else ''}: seeds per cell {seeds}")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def render(summary: dict) -> str:
    quick = " (--quick: plumbing on a random tiny model, 3 iterations, 1 seed; not a measurement)" \
        if summary["quick"] else ""
    out = [f"## Stress grid, tier {summary['tier']}{quick}", "",
           f"Tier: {summary['tier_description']}"
           + (f"; every run changed by `--set {' --set '.join(summary['sets'])}`" if summary.get("sets") else "")
           + ".", "",
           f"Command: `{summary['command']}`", "",
           f"Warm start: `{summary['warm_start']}`; {summary['iterations']} iterations per run; seeds "
           f"{summary['seeds']}.", "",
           *([f"Held-out score of the warm start: {summary['held_out_before']}.", ""] if summary["held_out_before"]
             else []),
           f"Collapse criterion (benchmarks/stability.py, `COLLAPSE`): {summary['collapse_criterion']}.", "",
           "### Stress levels", "",
           table(["level", "knobs", "stppo train options"],
                 [[name, ", ".join(f"{k}={v}" for k, v in knobs.items()), " ".join(summary["level_sets"][name])]
                  for name, knobs in summary["levels"].items()]), "",
           f"Options of every run: `{' '.join(summary['common_sets'])}`.", "", "### Cells", ""]
    header = ["tier", "level", "rule", "seeds", "collapsed", "rate [95% Wilson]", "median collapse iter",
              "collapsed seeds @ iter", "reward first -> last (mean)", "clip_frac", "turn_clip_frac",
              "token ratio max (median)", "ratio p99 (mean)", "turn ratio max (mean)", "clip_bias_scale (mean)"]
    families = sorted({f for lv in summary["cells"].values() for c in lv.values() if c["after"] for f in c["after"]})
    header += [f"{f} held-out" for f in families]
    rows = []
    for level in summary["levels_order"]:
        for rule in summary["rules"]:
            c = summary["cells"].get(level, {}).get(rule)
            if not c:
                continue
            rows.append([summary["tier"], level, rule, c["n"], f"{c['collapsed']}/{c['n']}",
                         f"{c['rate']:.2f} [{c['wilson95'][0]:.2f}, {c['wilson95'][1]:.2f}]",
                         "-" if c["median_collapse_iteration"] is None else f"{c['median_collapse_iteration']:g}",
                         ", ".join(f"s{s}@{i}" for s, i in c["collapsed_at"].items()) or "-",
                         f"{fmt(c['reward_first_mean'])} -> {fmt(c['reward_last_mean'])}", c["clip_frac_mean"],
                         c["turn_clip_frac_mean"], c["ratio_max_median"], c["ratio_p99_mean"],
                         c["turn_ratio_max_mean"], c.get("clip_bias_scale_mean"),
                         *[(c["after"] or {}).get(f) for f in families]])
    out += [table(header, rows), ""]
    if summary.get("figure"):
        out += [f"Figure: {summary['figure']}", ""]
    t = summary["timing"]
    out += [f"Time: runs done so far took {t['runs_wall_s'] / 60:.1f} min of wall time in all ({t['runs']} runs, "
            f"median {t['run_median_s']:.0f} s); this invocation {t['invocation_s'] / 60:.1f} min; machine: "
            f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={summary['omp_num_threads']}, load average "
            f"{t['load_start']:.1f} at start, {t['load_end']:.1f} at end."
            + ("" if summary["complete"] else " **Incomplete: the grid is still running or was stopped.**"), ""]
    return "\n".join(out)
