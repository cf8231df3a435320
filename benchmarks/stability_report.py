"""The stability study's report: its tables (markdown) from the summary that benchmarks/stability.py writes."""

from __future__ import annotations

import statistics

BENCHMARKS = {"general": "nq", "multi-hop": "hotpotqa", "medical": "medqa"}
QUICK_BANNER = "quick: checks the plumbing, not a result (a tiny random model, 1 iteration on stppo/Toy-v0)"


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render(summary: dict) -> str:
    out = [f"**{QUICK_BANNER}**", ""] if summary["settings"].get("quick") else []
    out += ["## Warm start (before RL)", "",
           table(list(BENCHMARKS), [[summary["before"][f] for f in BENCHMARKS]]), "",
           "## Replays of one recorded token-level PPO run through the PPO family", "",
           "Replaying with ppo reproduces the recorded run's update metrics exactly: "
           f"**{ {True: 'yes', False: 'NO', None: 'not checked'}[summary['replay_reproduces_recording']]}**.", ""]
    header = ["rule", "clip_frac mean/max", "off-policy clip_frac", "turn_clip_frac mean/max",
              "off-policy turn_clip_frac", "token ratio max", "turn ratio max", "off-policy ratio p99",
              "off-policy ‖C‖ mean", "clip_bias_scale mean", "grad cos to 1st (off-policy)", "grad norm p99",
              "KL to ref (last)", "minutes"]
    rows = []
    for algo, s in summary["replays"].items():
        rows.append([algo, f"{fmt(s['clip_frac_mean'])}/{fmt(s['clip_frac_max'])}", s["offpolicy_clip_frac_mean"],
                     f"{fmt(s['turn_clip_frac_mean'])}/{fmt(s['turn_clip_frac_max'])}",
                     s["offpolicy_turn_clip_frac_mean"], s["ratio_max"], s["turn_ratio_max"],
                     s["ratio_p99_offpolicy_mean"], s["clip_bias_norm_offpolicy_mean"], s["clip_bias_scale_mean"],
                     s["grad_cos_offpolicy_mean"], s["grad_norm_p99"], s["kl_to_reference_last"], s["minutes"]])
    out += [table(header, rows), ""]
    if summary["live"]:
        out += ["## Live runs", "", f"Collapse criterion: {summary['collapse_criterion']}.", ""]
        header = ["algo", "seed", "reward first -> last", "worst drawdown", "clip_frac mean/max",
                  "turn_clip_frac mean/max", "off-policy clip_frac", "grad norm p99", "clip_bias_scale mean",
                  "KL to ref (last)", "invalid rate", "collapsed at", *[f"{f} before -> after" for f in BENCHMARKS],
                  "minutes"]
        rows = []
        for algo, seeds in summary["live"].items():
            for seed, s in seeds.items():
                rows.append([algo, seed, f"{fmt(s['reward_first'])} -> {fmt(s['reward_last'])}", s["worst_drawdown"],
                             f"{fmt(s['clip_frac_mean'])}/{fmt(s['clip_frac_max'])}",
                             f"{fmt(s['turn_clip_frac_mean'])}/{fmt(s['turn_clip_frac_max'])}",
                             s["offpolicy_clip_frac_mean"], s["grad_norm_p99"], s["clip_bias_scale_mean"],
                             s["kl_to_reference_last"], s["invalid_action_rate_mean"], s["collapsed_at"] or "no",
                             *[f"{fmt(summary['before'][f])} -> {fmt(s['after'][f])}" for f in BENCHMARKS],
                             s["minutes"]])
        out += [table(header, rows), "", seed_means(summary), ""]
    # parts an earlier invocation finished take no time in this one: the "minutes" columns hold each run's own
    # training time (the sum of its iterations, without model loading and evaluation)
    timings = ", ".join(f"{k} {v / 60:.1f} min" for k, v in summary["timings_s"].items() if v >= 1)
    out += [f"This invocation: {summary['total_s'] / 60:.1f} min ({timings or 'everything was done before'})."
            + ("" if summary.get("complete", True) else " **Incomplete: the study is still running or was stopped.**"),
            ""]
    return "\n".join(out)


def seed_means(summary: dict) -> str:
    """Per algorithm, the mean over its seeds: the comparison the study is for (single seeds are noisy)."""
    keys = ["reward_last", "worst_drawdown", "clip_frac_mean", "turn_clip_frac_mean", "offpolicy_clip_frac_mean",
            "grad_norm_p99", "kl_to_reference_last"]
    header = ["algo", "seeds", "reward last", "worst drawdown", "clip_frac", "turn_clip_frac", "off-policy clip_frac",
              "grad norm p99", "KL to ref (last)", "collapsed", *[f"{f} after" for f in BENCHMARKS]]
    rows = []
    for algo, seeds in summary["live"].items():
        runs = list(seeds.values())

        def mean(values):
            values = [v for v in values if v is not None]
            return statistics.fmean(values) if values else None

        rows.append([algo, len(runs), *[mean([r[k] for r in runs]) for k in keys],
                     f"{sum(1 for r in runs if r['collapsed_at'])}/{len(runs)}",
                     *[mean([r["after"][f] for r in runs]) for f in BENCHMARKS]])
    return "Mean over seeds:\n\n" + table(header, rows)
