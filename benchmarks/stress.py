"""Stress benchmark: rank update rules by how often they collapse under off-policy stress.

    python benchmarks/stress.py [--tier toy|demo] [--out runs/stress-TIER] [--rules ppo,st_ppo,...]
                                [--levels none,mild,strong] [--level NAME:knob=value,...] [--seeds 0-4]
                                [--iterations N] [--set key=value ...] [--import myrule.py ...]
                                [--model PATH] [--device cpu|cuda] [--quick] [--report-only]

A grid of update rules x stress levels x seeds from one warm start. Per cell (rule, level): collapse rate with a 95%
Wilson interval, median iteration of collapse, final training reward, clip fractions and ratio tails (metrics.jsonl),
held-out score per family where the tier has one. OUT/report.md, OUT/summary.json, OUT/figures/stress-collapse.png
(collapse rate against stress level, one line per rule, interval bars). Collapse is benchmarks/stability.py's
criterion (``stability.COLLAPSE``, applied by ``stability.summarize``), quoted in the report and docs/stability.md.

Tiers (every table names its own): toy -- stppo/Toy-v0 (2 turns, 3 new tokens per turn, the env reads the first
word), a tiny random Llama (hidden 32, 2 layers, 9-token vocabulary), warm start = ppo at level none for 20
iterations from the random model (seed 1000), seconds per run, no held-out set; demo -- the demo set with
SmolLM2-135M-Instruct after stability.py's warm start and in its regime, held-out scores per family; with
--device cuda and --model a 0.5-3B instruct model it is the GPU path.

Levels are named knob sets (LADDER; --level adds or redefines one): ppo_epochs, mini_batches (the iteration's
trajectories split into this many optimizer steps per epoch), lr_scale (x the tier's base actor lr), and any other
training option (rollout_staleness=4, ...). --set applies to every run. The report spells each level out.

Resumable: a finished run leaves a done marker and its options (a folder run with others is refused); rerun to
continue. --report-only runs nothing. --quick: toy tier, the random model as warm start, ppo and st_ppo, levels none
and extreme, one seed, 3 iterations (plumbing for CI).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import types
from pathlib import Path

import stability  # noqa: F401  (its import puts the repository on sys.path)
import yaml
from stability import COLLAPSE, NotDone, drop_checkpoints, needs_run, stop_on_sigterm, stppo, summarize
from stability_report import fmt
from stress_report import plot, render

CORE_RULES = ["ppo", "turn_ppo", "s_ppo", "st_ppo", "grpo", "gspo", "so_grpo"]
# Levels, least stress first. Optimizer steps per iteration = ppo_epochs x mini_batches, of which all but the first
# are off-policy; lr_scale multiplies the tier's base actor lr.
LADDER = {
    "none": {"ppo_epochs": 1, "mini_batches": 1, "lr_scale": 1},
    "mild": {"ppo_epochs": 2, "mini_batches": 4, "lr_scale": 1},
    "strong": {"ppo_epochs": 4, "mini_batches": 4, "lr_scale": 10},
    # strong's knobs on rollouts sampled by the policy of 4 iterations earlier (an asynchronous trainer's data)
    "stale": {"ppo_epochs": 4, "mini_batches": 4, "lr_scale": 10, "rollout_staleness": 4},
    "extreme": {"ppo_epochs": 4, "mini_batches": 4, "lr_scale": 100},
    # a control, not on the default ladder: extreme's lr with one on-policy step per iteration
    "lr_only": {"ppo_epochs": 1, "mini_batches": 1, "lr_scale": 100},
    # not on the default ladder: a bfloat16 sampler against the float32 learner (a bfloat16 inference engine's
    # gap), uncorrected, at none's and at strong's knobs
    "mismatch": {"ppo_epochs": 1, "mini_batches": 1, "lr_scale": 1, "generation_autocast_dtype": "bfloat16",
                 "algorithm.rollout_correction": "none"},
    "strong_mismatch": {"ppo_epochs": 4, "mini_batches": 4, "lr_scale": 10, "generation_autocast_dtype": "bfloat16",
                        "algorithm.rollout_correction": "none"},
}
DEFAULT_LEVELS = ["none", "mild", "strong", "stale", "extreme"]
Z95 = 1.959963984540054


@dataclasses.dataclass(frozen=True)
class Tier:
    """Where the grid runs: env, regime, warm start and (demo) held-out evaluation."""
    name: str
    env: str
    base_lr: float
    trajectories: int
    micro: int
    iterations: int
    common: list
    describe: str


TOY = Tier("toy", "stppo/Toy-v0", 3e-3, 32, 16, 10,
           ["env_kwargs.fixed_target=null", "prompts_per_iteration=8", "samples_per_prompt=4", "critic_lr=3e-3",
            "max_turns=2", "max_new_tokens_per_turn=3", "max_prompt_tokens=8", "max_total_tokens=32"],
           "stppo/Toy-v0 (the target drawn per episode from 4 words, 2 turns, 3 new tokens per turn), tiny random "
           "Llama (hidden 32, 2 layers, 9-token "
           "vocabulary), warm start: ppo at level none for 20 iterations from the random model, 8 prompts x 4 "
           "samples = 32 trajectories per iteration, critic lr 3e-3, presets' own KL settings, float32 forwards")
DEMO = Tier("demo", stability.STUDY_ENV, 1e-5, 32, 4, 4, [],
            "demo set (NQ-, HotpotQA-, MedQA-like; BM25), SmolLM2-135M-Instruct after stability.py's warm start "
            "(or --model), benchmarks/stability.py's regime: 8 prompts x 4 samples = 32 trajectories of up to 3 "
            "turns, 48 new tokens per turn, critic lr 1e-5, bfloat16 autocast forwards; held-out: 16 questions per "
            "family, greedy")


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion k/n (95% by default): unlike p +- z*se it stays inside
    [0, 1] and is not empty at 0/n or n/n, which small seed counts hit all the time."""
    if n == 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return (0.0 if k == 0 else centre - half), (1.0 if k == n else centre + half)


def parse_level(spec: str) -> tuple[str, dict]:
    """``stale4:ppo_epochs=2,mini_batches=4,rollout_staleness=4`` -> ("stale4", {...}); values read as YAML would."""
    name, sep, body = spec.partition(":")
    if not sep or not name:
        raise SystemExit(f"--level expects NAME:knob=value,..., got {spec!r}")
    knobs = dict(LADDER.get(name, LADDER["none"]))
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--level {spec}: {item!r} is not knob=value")
        knobs[key.strip()] = yaml.safe_load(value)
    return name, knobs


def level_overrides(tier: Tier, knobs: dict) -> list[str]:
    """A level's knobs as the `--set` options of `stppo train` (the report prints exactly these)."""
    mini = tier.trajectories // int(knobs["mini_batches"])
    if mini * int(knobs["mini_batches"]) != tier.trajectories:
        raise SystemExit(f"mini_batches={knobs['mini_batches']} does not divide the {tier.trajectories} trajectories")
    sets = [f"ppo_epochs={knobs['ppo_epochs']}", f"mini_batch_size={mini}",
            f"micro_batch_size={math.gcd(mini, tier.micro)}", f"actor_lr={tier.base_lr * float(knobs['lr_scale']):g}"]
    return sets + [f"{k}={v}" for k, v in knobs.items() if k not in ("ppo_epochs", "mini_batches", "lr_scale")]


def run_overrides(args, tier: Tier, knobs: dict, seed: int) -> list[str]:
    """The tier's options (demo: stability.py's, whose ppo_epochs and lr the level's override: later --set wins),
    the level's, the seed, then --set."""
    common = stability.train_overrides(stability_settings(args), seed) if tier is DEMO else tier.common
    return [*common, *level_overrides(tier, knobs), f"seed={seed}", f"device={args.device}", "save_every=1000",
            "keep_checkpoints=1", "progress=false", "tensorboard=false", *args.sets]


def train(args, tier: Tier, model: str, rule: str, sets: list[str], iterations: int, out: Path) -> float | None:
    """One `stppo train` run (resumable through its done marker); returns its wall seconds when it ran now."""
    record = out / "stress.json"
    if (out / "done").exists():
        ran_with = json.loads(record.read_text())
        if ran_with["sets"] != sets or ran_with["model"] != model or ran_with["iterations"] != iterations:
            raise SystemExit(f"{out} was run with other options ({ran_with}); use another --out")
        return None
    needs_run(out)  # clears a run cut mid-way; raises NotDone under --report-only
    started = time.perf_counter()
    stppo("train", "--algo", rule, "--env", tier.env, "--model", model, "--output-dir", str(out),
          "--iterations", str(iterations), *[a for spec in args.imports for a in ("--import", spec)],
          *[a for item in sets for a in ("--set", item)])
    wall = time.perf_counter() - started
    record.write_text(json.dumps({"rule": rule, "sets": sets, "model": model, "iterations": iterations,
                                  "wall_s": wall, "load": os.getloadavg()}) + "\n")
    (out / "done").write_text("")
    return wall


def warm_start(args, tier: Tier) -> str:
    if args.model:
        return args.model
    if tier is DEMO:
        return stability.warm_start(stability_settings(args))
    from stppo_agent.models.tiny import build_tiny_llama

    base = args.out / "tiny"
    if not (base / "config.json").exists():
        if args.report_only:
            raise NotDone(str(base))
        build_tiny_llama(base, hidden=32, layers=2)
    if args.quick:  # plumbing only: the random model is the warm start
        return str(base)
    out, iterations = args.out / "warm-start", 20
    train(args, tier, str(base), "ppo", run_overrides(args, tier, LADDER["none"], 1000), iterations, out)
    return str(out / "checkpoints" / f"step-{iterations}" / "actor")


def stability_settings(args) -> stability.Settings:
    return stability.Settings(args.out, None, args.iterations, [], [], DEMO.base_lr, 16, args.device, False, [],
                              False, autocast_dtype=None if args.autocast_dtype == "none" else args.autocast_dtype,
                              keep_checkpoints=args.keep_checkpoints)


def run_summary(run: Path) -> dict:
    """stability.summarize's figures (and its collapse verdict) plus the ratio tails metrics.jsonl logs."""
    from stppo_agent.runs.metrics_log import read_metrics

    summary = summarize(run)
    records = read_metrics(run)

    def values(key):
        return [r[key] for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]

    summary.update({"ratio_max": max(values("tail/ratio_max"), default=None),
                    "ratio_p99_mean": statistics.fmean(values("tail/ratio_p99")) if values("tail/ratio_p99") else None,
                    "turn_ratio_max": max(values("tail/turn_ratio_max"), default=None),
                    "wall_s": json.loads((run / "stress.json").read_text()).get("wall_s")})
    return summary


def median(values: list) -> float | None:
    return statistics.median(values) if values else None


def cell_summary(runs: dict[int, dict]) -> dict:
    """Per (rule, level): collapse count and rate with its 95% Wilson interval, medians and means over seeds."""
    n = len(runs)
    collapsed = {seed: r["collapsed_at"] for seed, r in runs.items() if r["collapsed_at"] is not None}
    low, high = wilson(len(collapsed), n)

    def mean(key):
        vals = [r[key] for r in runs.values() if r.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    after = [r["after"] for r in runs.values() if r.get("after")]
    return {"seeds": sorted(runs), "n": n, "collapsed": len(collapsed), "rate": len(collapsed) / n if n else None,
            "wilson95": [low, high], "collapsed_at": collapsed,
            "median_collapse_iteration": median(list(collapsed.values())),
            "reward_last_mean": mean("reward_last"), "reward_first_mean": mean("reward_first"),
            "clip_frac_mean": mean("clip_frac_mean"), "turn_clip_frac_mean": mean("turn_clip_frac_mean"),
            "clip_bias_scale_mean": mean("clip_bias_scale_mean"),
            "ratio_max_median": median([r["ratio_max"] for r in runs.values() if r["ratio_max"] is not None]),
            "ratio_p99_mean": mean("ratio_p99_mean"), "turn_ratio_max_mean": mean("turn_ratio_max"),
            "after": {f: statistics.fmean(a[f] for a in after) for f in after[0]} if after else None}


def parse_seeds(text: str) -> list[int]:
    """``0-4`` or ``0,1,7`` (or both: ``0-2,9``)."""
    seeds: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, dash, last = part.partition("-")
        seeds += list(range(int(first), int(last) + 1)) if dash else [int(first)]
    return list(dict.fromkeys(seeds))


def parse_args(argv=None):
    from stppo_agent.plugins.loader import add_import_argument

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", choices=("toy", "demo"), default="toy")
    parser.add_argument("--out", default=None, help="default runs/stress-TIER (runs/stress-quick with --quick)")
    parser.add_argument("--rules", default=None,
                        help=f"update rules (default: {','.join(CORE_RULES)}, then every other registered preset, "
                             "plugins' included)")
    parser.add_argument("--levels", default=None,
                        help=f"stress levels, least first (default {','.join(DEFAULT_LEVELS)})")
    parser.add_argument("--level", action="append", default=[], metavar="NAME:knob=value,...",
                        help="add or redefine a level: knobs ppo_epochs, mini_batches, lr_scale, or any training "
                             "option (rollout_staleness=4); unnamed knobs keep the level's (or none's) values")
    parser.add_argument("--seeds", default="0-4")
    parser.add_argument("--iterations", type=int, default=None, help="per run (default: the tier's)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a training option for every run (recorded; a finished run with others is refused)")
    add_import_argument(parser)
    parser.add_argument("--model", default=None, help="the warm start (default: the tier's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast-dtype", default="bfloat16", choices=("bfloat16", "none"),
                        help="demo tier: forwards under bfloat16 autocast, as benchmarks/stability.py")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--quick", action="store_true", help="toy tier plumbing for CI (see above)")
    parser.add_argument("--report-only", action="store_true", help="run nothing; report what is done")
    args = parser.parse_args(argv)
    if args.quick:
        args.tier = "toy"
    args.out = Path(args.out or ("runs/stress-quick" if args.quick else f"runs/stress-{args.tier}"))
    return args


def resolve_rules(args) -> list[str]:
    """The rules asked for, plugins imported first; each checked (with did-you-mean) before anything runs."""
    from stppo_agent.algorithms import ALGORITHMS
    from stppo_agent.plugins.loader import load_plugins
    from stppo_agent.plugins.name_checks import check_algorithm

    load_plugins(args.imports)
    if args.rules:
        rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    else:
        rules = ["ppo", "st_ppo"] if args.quick else list(dict.fromkeys([*CORE_RULES, *ALGORITHMS]))
    for rule in rules:
        try:
            check_algorithm(rule)
        except ValueError as exc:
            raise SystemExit(str(exc))
    return rules


def main(argv=None) -> None:
    stop_on_sigterm()
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    args = parse_args(argv)
    stability.REPORT_ONLY = args.report_only
    tier = TOY if args.tier == "toy" else DEMO
    if tier is TOY:  # a tiny model gains nothing from 2 threads, and on a loaded CPU their barriers cost seconds a step
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    iterations = args.iterations or (3 if args.quick else tier.iterations)
    rules = resolve_rules(args)
    levels = {name: dict(LADDER[name]) for name in LADDER}
    levels.update(parse_level(spec) for spec in args.level)
    order = [lv.strip() for lv in (args.levels or ("none,extreme" if args.quick else ",".join(DEFAULT_LEVELS)))
             .split(",") if lv.strip()] or DEFAULT_LEVELS
    for name in order:
        if name not in levels:
            raise SystemExit(f"unknown level {name!r}; known: {', '.join(levels)} (or define it with --level)")
    seeds = parse_seeds(args.seeds)[:1] if args.quick else parse_seeds(args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        model = warm_start(args, tier)
    except NotDone:
        raise SystemExit(f"--report-only: the warm start under {args.out} is not done yet; nothing to report")
    if tier is DEMO:
        try:
            args.before = stability.evaluate(stability_settings(args), model, args.out / "eval" / "warm-start")
        except NotDone:
            args.before = None
    runs: dict[str, dict[str, dict[int, dict]]] = {}
    complete = True
    # Seed by seed, every cell of a seed before the next: a grid stopped early leaves whole comparisons.
    for seed in seeds:
        for level in order:
            for rule in rules:
                run = args.out / "runs" / level / rule / f"s{seed}"
                try:
                    train(args, tier, model, rule, run_overrides(args, tier, levels[level], seed), iterations, run)
                    summary = run_summary(run)
                    if tier is DEMO:
                        summary["after"] = stability.evaluate(
                            stability_settings(args), str(run / "checkpoints" / f"step-{iterations}" / "actor"),
                            args.out / "eval" / level / rule / f"s{seed}")
                except NotDone:
                    complete = False
                    continue
                drop_checkpoints(types.SimpleNamespace(keep_checkpoints=args.keep_checkpoints), run)
                runs.setdefault(level, {}).setdefault(rule, {})[seed] = summary
                print(f"[{time.perf_counter() - started:6.0f}s] {level} {rule} s{seed}: collapsed at "
                      f"{summary['collapsed_at']}, reward {fmt(summary['reward_last'])}", flush=True)
        write(args, tier, model, rules, levels, order, seeds, iterations, runs, started, load_start, False)
    write(args, tier, model, rules, levels, order, seeds, iterations, runs, started, load_start, complete)
    print((args.out / "report.md").read_text())


def write(args, tier, model, rules, levels, order, seeds, iterations, runs, started, load_start, complete) -> None:
    walls = [r["wall_s"] for lv in runs.values() for rl in lv.values() for r in rl.values() if r.get("wall_s")]
    summary = {
        "tier": tier.name, "tier_description": tier.describe, "quick": args.quick, "warm_start": model,
        "held_out_before": getattr(args, "before", None), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "sets": args.sets,
        "command": " ".join(["python", "benchmarks/stress.py", *(sys.argv[1:] if sys.argv[1:] else [])]),
        "rules": rules, "levels_order": order, "levels": {n: levels[n] for n in order},
        "level_sets": {n: level_overrides(tier, levels[n]) for n in order}, "seeds": seeds, "iterations": iterations,
        "common_sets": [s for s in run_overrides(args, tier, LADDER["none"], 0)
                        if s not in level_overrides(tier, LADDER["none"])],
        "collapse_criterion": COLLAPSE, "complete": complete,
        "cells": {level: {rule: cell_summary(r) for rule, r in by_rule.items()} for level, by_rule in runs.items()},
        "runs": runs,
        "timing": {"runs_wall_s": sum(walls), "runs": len(walls), "run_median_s": median(walls) or 0.0,
                   "invocation_s": time.perf_counter() - started, "load_start": load_start,
                   "load_end": os.getloadavg()[0]},
    }
    if summary["cells"]:
        summary["figure"] = plot(summary, args.out / "figures" / "stress-collapse.png")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (args.out / "report.md").write_text(render(summary))


if __name__ == "__main__":
    main()
