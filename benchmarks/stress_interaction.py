"""Which rule pays less for a stressor: the paired interaction of a stress grid's final rewards.

    python benchmarks/stress_interaction.py runs/stress-toy/summary.json turn_ppo:ppo,st_ppo:ppo [--control lag0]
    python benchmarks/stress_interaction.py runs/stress-toy/summary.json wide64/ppo:lag64/turn_ppo [--control lag0]

For each pair RULE:REF and each level L other than the control, per seed: (RULE at L - RULE at the control) -
(REF at L - REF at the control), the difference in what the stress cost the two rules. A rule that differs from
its reference also on the control (turn-level ratios average each turn's advantages even on-policy) is compared on
the cost of the stress alone. Wilcoxon signed-rank over the seeds all four runs share (two-sided; zero
differences dropped). A run's final reward is benchmarks/stress_cells.py's (the mean of its last read-outs).

A pair of arms LEVEL/RULE:LEVEL/RULE compares two cells that differ in more than the rule -- a control arm such as
ppo with a widened clip against turn_ppo under the same lag -- where they ended (paired by seed) and what the
stress cost each, each arm measured from its own rule's control level.
"""

from __future__ import annotations

import argparse
import json

from stress_cells import final_reward
from stress_report import reward_text
from stress_stats import compare_values


def interactions(runs: dict, rule: str, reference: str, control: str) -> dict[str, dict]:
    """``{level: compare_values result}`` of the per-seed stress cost of ``rule`` minus that of ``reference``."""
    return {level: arm_comparison(runs, (level, rule), (level, reference), control)["cost"]
            for level, cells in runs.items() if level != control and rule in cells and reference in cells}


def arm_comparison(runs: dict, arm: tuple[str, str], reference: tuple[str, str], control: str) -> dict:
    """Two (level, rule) cells on the seeds they and both rules' ``control`` runs share: ``ended``, the paired
    difference of their final rewards (arm - reference), and ``cost``, of what the stress cost each -- (arm - its
    rule at the control) - (reference - its rule at the control)."""
    (level, rule), (reference_level, reference_rule) = arm, reference
    runs_of = [runs.get(level, {}).get(rule, {}), runs.get(reference_level, {}).get(reference_rule, {}),
               runs.get(control, {}).get(rule, {}), runs.get(control, {}).get(reference_rule, {})]
    first, second, first_control, second_control = runs_of
    seeds = set.intersection(*(set(cell) for cell in runs_of))
    if not seeds:
        raise SystemExit(f"no seed ran all of {level}/{rule}, {reference_level}/{reference_rule} and their rules at "
                         f"{control}: nothing to pair")
    ended = {s: final_reward(first[s]) for s in seeds}, {s: final_reward(second[s]) for s in seeds}
    cost = ({s: ended[0][s] - final_reward(first_control[s]) for s in seeds},
            {s: ended[1][s] - final_reward(second_control[s]) for s in seeds})
    return {"ended": compare_values(*ended, paired=True), "cost": compare_values(*cost, paired=True)}


def _describe(result: dict) -> str:
    """A paired comparison as the stress report writes one: difference [95% t interval] (wins, losses; p)."""
    return reward_text({"final_reward": result})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", help="a stress grid's summary.json")
    parser.add_argument("pairs", help="RULE:REFERENCE or LEVEL/RULE:LEVEL/RULE, comma-separated")
    parser.add_argument("--control", default="lag0", help="the level the cost is measured from (default lag0)")
    args = parser.parse_args()
    runs = json.load(open(args.summary))["runs"]
    for pair in args.pairs.split(","):
        first, second = pair.split(":")
        if "/" in first:
            result = arm_comparison(runs, tuple(first.split("/")), tuple(second.split("/")), args.control)
            print(f"{first} - {second}: ended {_describe(result['ended'])}")
            print(f"  lost {_describe(result['cost'])} less to the stress than {second}, each from its rule at "
                  f"{args.control}")
            continue
        for level, result in interactions(runs, first, second, args.control).items():
            print(f"{level}: {first} lost {_describe(result)} less than {second} to it")


if __name__ == "__main__":
    main()
