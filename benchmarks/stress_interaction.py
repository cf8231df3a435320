"""Which rule pays less for a stressor: the paired interaction of a stress grid's final rewards.

    python benchmarks/stress_interaction.py runs/stress-toy/summary.json turn_ppo:ppo,st_ppo:ppo [--control lag0]

For each pair RULE:REF and each level L other than the control, per seed: (RULE at L - RULE at the control) -
(REF at L - REF at the control), the difference in what the stress cost the two rules. A rule that differs from
its reference also on the control (turn-level ratios average each turn's advantages even on-policy) is compared on
the cost of the stress alone. Wilcoxon signed-rank over the seeds all four runs share (two-sided; zero
differences dropped). A run's final reward is benchmarks/stress_cells.py's (the mean of its last read-outs).
"""

from __future__ import annotations

import argparse
import json

from stress_cells import final_reward
from stress_stats import compare_values


def interactions(runs: dict, rule: str, reference: str, control: str) -> dict[str, dict]:
    """``{level: compare_values result}`` of the per-seed stress cost of ``rule`` minus that of ``reference``."""
    out = {}
    for level, cells in runs.items():
        if level == control or rule not in cells or reference not in cells:
            continue
        base = runs.get(control, {})
        seeds = set(cells[rule]) & set(cells[reference]) & set(base.get(rule, {})) & set(base.get(reference, {}))
        cost = {s: final_reward(cells[rule][s]) - final_reward(base[rule][s]) for s in seeds}
        reference_cost = {s: final_reward(cells[reference][s]) - final_reward(base[reference][s]) for s in seeds}
        out[level] = compare_values(cost, reference_cost, paired=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", help="a stress grid's summary.json")
    parser.add_argument("pairs", help="RULE:REFERENCE[,RULE:REFERENCE...]")
    parser.add_argument("--control", default="lag0", help="the level the cost is measured from (default lag0)")
    args = parser.parse_args()
    runs = json.load(open(args.summary))["runs"]
    for pair in args.pairs.split(","):
        rule, reference = pair.split(":")
        for level, result in interactions(runs, rule, reference, args.control).items():
            low, high = result["ci95"] or (float("nan"), float("nan"))
            print(f"{level}: {rule} lost {result['mean_difference']:+.3f} (95% t interval {low:+.3f} to {high:+.3f}) "
                  f"less than {reference} to it ({result['wins']} seeds up, {result['losses']} down of "
                  f"{result['pairs']}; Wilcoxon p={result['p']:.3g})")


if __name__ == "__main__":
    main()
