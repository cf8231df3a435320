"""Stress benchmark: does off-policy stress alone -- at a learning rate where on-policy training is stable --
collapse an update rule, and which rules resist it?

    python benchmarks/stress.py [--tier toy|copy|demo|gpu] [--out runs/stress-TIER] [--rules ppo,st_ppo,...]
                                [--levels lag0,lag16,...] [--level NAME:knob=value,...] [--seeds 0-9]
                                [--iterations N] [--lr LR] [--set key=value ...] [--import myrule.py ...]
                                [--model PATH] [--device cpu|cuda] [--jobs 2] [--quick] [--report-only]

A grid of update rules x stress levels x paired seeds from one warm start. Each level varies one thing against a
matched control at the tier's fixed learning rate (benchmarks/stress_levels.py): the lag ladder (rollout.staleness
K at one optimizer step per iteration; lag0 is the on-policy control with the same lr, steps, batch and mini-batch
by construction), the reuse ladder (epochs x mini-batches on one batch) against step-matched on-policy controls,
and mechanism levels (a bfloat16 sampler's log-probs in the ratio, dual clip, the clip-bias correction after
gradient clipping). Every run continues from the warm start's weights, critic and optimizer state (init_from,
where this stppo has it) and shares warmup_steps.

Read-outs are version-aligned (N per run: --iterations): the learner probe of the current actor every few
iterations (probe_every, tier default), or without it the rollouts of iterations K..K+N-1 of a K-lag run. Collapse is
benchmarks/collapse_criterion.py's persistent criterion (``CRITERION``, quoted in the report and docs/stability.md);
dips that recover are counted apart. Per cell the report (OUT/report.md, OUT/summary.json,
OUT/figures/stress-collapse.png; the first two also as OUT/reports/LEVELS--RULES.md/.json, one per selection)
gives n, collapses, dips, the Wilson interval, the exact test against the matched
control and against the reference rule (McNemar where seeds pair, checked by their first batch; Fisher otherwise),
the detectable difference, precursors, and per level its exact options and both learning rates.

Tiers: toy -- stppo/Toy-v0 (2 turns, 3 new tokens per turn, the env reads the first word; reward-only criterion),
a tiny random Llama; copy -- stppo/Copy-v0 (repeat 16 of 64 symbols per turn, 2 turns: every generated token is
read), a tiny Llama taught to copy to a sampled accuracy of ~0.4 (benchmarks/copy_warm_start.py); demo -- the demo
set with SmolLM2 after stability.py's warm start (no RL warm start there: warmup_steps only); gpu -- stppo/Copy-v0
with a real model (--model, default smollm2) on --device cuda (benchmarks/stress_gpu.py runs and times it).

Resumable: a finished run leaves a done marker and its options (a folder run with other options is refused); rerun
to continue. --report-only runs nothing. --quick: the lag and reuse ladders at tiny sizes (lag0, lag2, reuse2x2 with
its control steps4), ppo and st_ppo, one seed, 3 read-outs, a 2-iteration warm start, the probe every iteration
(plumbing for CI; --tier copy --quick does the same on the copy tier).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
import types
from pathlib import Path

import stability  # noqa: F401  (its import puts the repository on sys.path)
from collapse_criterion import CRITERION
from stability import NotDone, drop_checkpoints, needs_run, stop_on_sigterm, stppo
from stability_report import fmt
from stress_cells import cell_summary, comparisons
from stress_levels import (
    DEFAULT_LEVELS,
    QUICK_LEVELS,
    effective,
    has_option,
    known_levels,
    missing_options,
    parse_level,
    plan,
)
from stress_readout import run_readout
from stress_report import plot, render
from stress_stats import wilson  # noqa: F401  (the grid's interval; tests read it here)
from stress_tiers import COPY, DEMO, GPU, TIERS, TOY, Tier  # noqa: F401  (TOY: tests read it here)

CORE_RULES = ["ppo", "turn_ppo", "s_ppo", "st_ppo", "grpo", "so_grpo"]
DEFAULT_RULES = ["ppo", "st_ppo"]
LEVEL_OWNED = ("optimizer.epochs", "optimizer.mini_batch_size", "optimizer.micro_batch_size", "optimizer.actor_lr",
               "optimizer.critic_lr")
QUICK_SETS = ["monitor.probe_every=1", "monitor.probe_prompts=4"]



def run_overrides(args, tier: Tier, name: str, seed: int) -> tuple[list[str], object]:
    """Every `stppo train` option of one run and its level's plan: the tier's (demo: stability.py's), --set, the
    level's own (which win), the seed, where to start from."""
    common = stability.train_overrides(stability_settings(args), seed) if tier is DEMO else tier.common
    base = [*common, *base_sets(args, tier)[len(tier.common):]]
    level_plan = plan(tier_with_lr(tier, args), args.levels, name, base, args.versions)
    start = [f"init_from={args.init_from}"] if args.init_from else []
    return [*base, *level_plan.sets, f"seed={seed}", f"device={args.device}", "checkpoint.every=1000",
            "checkpoint.keep=1", "logging.progress=false", "logging.tensorboard=false", *start], level_plan


def base_sets(args, tier: Tier) -> list[str]:
    """The tier's options of every run, --quick's, then --set."""
    return [*tier.common, *(QUICK_SETS if args.quick else []), *args.sets]


def tier_with_lr(tier: Tier, args) -> Tier:
    return dataclasses.replace(tier, base_lr=args.lr) if args.lr is not None else tier


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


def warm_start(args, tier: Tier) -> tuple[str, str | None, str]:
    """(the model every run starts from, the checkpoint whose critic and optimizer state it continues, a note)."""
    if args.model and tier is not GPU:
        return args.model, None, "given by --model: weights only, every level shares warmup_steps"
    if tier is DEMO:
        return stability.warm_start(stability_settings(args)), None, \
            "stppo sft (no RL warm start on this tier: weights only, every level shares warmup_steps)"
    from stppo_agent.models.tiny import build_copy_llama, build_tiny_llama

    base = args.out / ("tiny" if tier is TOY else "model")
    if tier is TOY and not (base / "config.json").exists():
        if args.report_only:
            raise NotDone(str(base))
        build_tiny_llama(base, hidden=32, layers=2)
    elif tier is not TOY:
        from copy_warm_start import warm_start as supervised

        if args.report_only and not (base / "warm_start.json").exists():
            raise NotDone(str(base))
        source = args.model or "smollm2"
        if tier is COPY:
            source = str(build_copy_llama(args.out / "tiny")) if not (args.out / "tiny").exists() \
                else str(args.out / "tiny")
        else:
            from stppo_agent.models.default_model import resolve_model

            source = resolve_model(source)
        supervised(source, base, target=0.1 if args.quick else 0.4, lr=args.warm_start_lr or tier.copy_warm_start_lr,
                   device=args.device,
                   max_new_tokens_per_turn=int(effective(base_sets(args, tier), "rollout.max_new_tokens_per_turn")))
    iterations = 2 if args.quick else tier.warm_start_iterations
    out = args.out / "warm-start"
    common = base_sets(args, tier)
    sets = [*common, *plan(tier_with_lr(tier, args), args.levels, "lag0", common, 1).sets,
            "monitor.probe_every=0", "seed=1000", f"device={args.device}", "checkpoint.every=1000", "checkpoint.keep=1",
            "logging.progress=false", "logging.tensorboard=false"]
    train(args, tier, str(base), "ppo", sets, iterations, out)
    checkpoint = out / "checkpoints" / f"step-{iterations}"
    carried = has_option("init_from")
    note = (f"ppo at lag0 for {iterations} iterations (seed 1000) from {base.name}; every run continues from its "
            + ("actor, critic and optimizer state (init_from) and " if carried else "actor (this stppo has no "
               "init_from: a fresh optimizer) and ") + "shares warmup_steps=10")
    return str(checkpoint / "actor"), str(checkpoint) if carried else None, note


def stability_settings(args) -> stability.Settings:
    return stability.Settings(args.out, None, args.versions, [], [], DEMO.base_lr, 16, args.device, False, [],
                              False, autocast_dtype=None if args.autocast_dtype == "none" else args.autocast_dtype,
                              keep_checkpoints=args.keep_checkpoints)


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
    parser.add_argument("--tier", choices=tuple(TIERS), default=None, help="default toy")
    parser.add_argument("--out", default=None, help="default runs/stress-TIER (runs/stress-quick with --quick)")
    parser.add_argument("--rules", default=None,
                        help=f"update rules (default {','.join(DEFAULT_RULES)}; 'core': {','.join(CORE_RULES)}; "
                             "'all': every registered preset, plugins' included)")
    parser.add_argument("--levels", dest="levels_arg", default=None,
                        help=f"stress levels (default {','.join(DEFAULT_LEVELS)})")
    parser.add_argument("--level", action="append", default=[], metavar="NAME:knob=value,...",
                        help="add or redefine a level (knobs: benchmarks/stress_levels.py)")
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--iterations", type=int, default=None,
                        help="read-outs (policy versions) per run (default: the tier's)")
    parser.add_argument("--lr", type=float, default=None, help="the tier's base actor learning rate (pilot it)")
    parser.add_argument("--warm-start-lr", type=float, default=None,
                        help="copy and gpu tiers: the supervised warm start's lr (default 1e-3; gpu 2e-5)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a training option for every run (recorded; a finished run with others is refused)")
    add_import_argument(parser)
    parser.add_argument("--model", default=None, help="the warm start (default: the tier's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast-dtype", default="bfloat16", choices=("bfloat16", "none"),
                        help="demo tier: forwards under bfloat16 autocast, as benchmarks/stability.py")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one process each)")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--quick", action="store_true", help="the ladders at tiny sizes for CI (see above)")
    parser.add_argument("--report-only", action="store_true", help="run nothing; report what is done")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.tier = args.tier or "toy"
    if args.quick and args.tier == "demo":
        raise SystemExit("--quick runs the toy, copy or gpu tier (the demo tier has no tiny warm start)")
    owned = [s for s in args.sets if s.partition("=")[0] in LEVEL_OWNED]
    if owned:
        raise SystemExit(f"--set {owned[0]}: levels set {', '.join(LEVEL_OWNED)}; use --lr, or a level's lr_scale, "
                         "critic_lr_scale, ppo_epochs and mini_batches knobs (--level)")
    args.out = Path(args.out or ("runs/stress-quick" if args.quick else f"runs/stress-{args.tier}"))
    return args


def resolve_rules(args) -> list[str]:
    """The rules asked for, plugins imported first; each checked (with did-you-mean) before anything runs."""
    from stppo_agent.algorithms import ALGORITHMS
    from stppo_agent.plugins.loader import load_plugins
    from stppo_agent.plugins.name_checks import check_algorithm

    load_plugins(args.imports)
    spec = args.rules or ",".join(DEFAULT_RULES)
    rules = {"core": CORE_RULES, "all": list(dict.fromkeys([*CORE_RULES, *ALGORITHMS]))}.get(
        spec, [r.strip() for r in spec.split(",") if r.strip()])
    for rule in rules:
        try:
            check_algorithm(rule)
        except ValueError as exc:
            raise SystemExit(str(exc))
    return rules


def resolve_levels(args) -> list[str]:
    """The levels to run, each checked (known, its control and matched level known, its options in this stppo)
    before anything runs; sets ``args.levels`` to every level's knobs."""
    levels = known_levels()
    for spec in args.level:
        name, knobs = parse_level(spec, levels)
        levels[name] = knobs
    args.levels = levels
    default = QUICK_LEVELS if args.quick else DEFAULT_LEVELS
    order = [lv.strip() for lv in args.levels_arg.split(",") if lv.strip()] if args.levels_arg else list(default)
    tier = TIERS[args.tier]
    for name in order:
        if name not in levels:
            raise SystemExit(f"unknown level {name!r}; known: {', '.join(levels)} (or define it with --level)")
        for ref in (levels[name].get("control"), levels[name].get("matches")):
            if ref and ref not in levels:
                raise SystemExit(f"level {name} refers to level {ref!r}, which is not defined")
        missing = missing_options(plan(tier, levels, name, tier.common, 1).sets)
        if missing:
            raise SystemExit(f"level {name} needs the training option {missing[0]}, which this stppo does not have; "
                             "leave the level out")
    return order


def summarize_run(run: Path, level_plan, args, tier: Tier) -> dict:
    from stppo_agent.runs.metrics_log import read_metrics

    records = read_metrics(run)
    summary = run_readout(records, level_plan.staleness, level_plan.scale, level_plan.steps_per_iteration,
                          level_plan.versions, tier.counts_invalid)
    summary["wall_s"] = json.loads((run / "stress.json").read_text()).get("wall_s")
    seconds = [r["iteration_seconds"] for r in records if "iteration_seconds" in r]
    summary["iteration_s"] = statistics.median(seconds) if seconds else None
    return summary


def main(argv=None) -> None:
    stop_on_sigterm()
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    args = parse_args(argv)
    stability.REPORT_ONLY = args.report_only
    tier = TIERS[args.tier]
    if tier in (TOY, COPY):  # a tiny model gains nothing from 2 threads, and on a loaded CPU their barriers cost
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.versions = args.iterations or (3 if args.quick else tier.iterations)
    rules = resolve_rules(args)
    order = resolve_levels(args)
    seeds = parse_seeds(args.seeds)[:1] if args.quick else parse_seeds(args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    args.init_from = None
    try:
        model, args.init_from, note = warm_start(args, tier)
    except NotDone:
        raise SystemExit(f"--report-only: the warm start under {args.out} is not done yet; nothing to report")
    args.before = None
    if tier is DEMO:
        try:
            args.before = stability.evaluate(stability_settings(args), model, args.out / "eval" / "warm-start")
        except NotDone:
            pass
    grid = Grid(args, tier, model, note, rules, order, seeds, started, load_start)
    grid.run()
    print((args.out / "report.md").read_text())


class Grid:
    """The runs of a grid, seed by seed (every cell of a seed before the next: a grid stopped early leaves whole
    comparisons), ``--jobs`` at a time, and its report rewritten as runs finish."""

    def __init__(self, args, tier, model, note, rules, order, seeds, started, load_start):
        self.args, self.tier, self.model, self.note = args, tier, model, note
        self.rules, self.order, self.seeds = rules, order, seeds
        self.started, self.load_start = started, load_start
        self.runs: dict[str, dict[str, dict[int, dict]]] = {}
        self.complete, self.lock = True, threading.Lock()

    def tasks(self) -> list[tuple[int, str, str]]:
        out = []
        for seed in self.seeds:
            for level in self.order:
                only = self.args.levels[level].get("only")
                for rule in self.rules:
                    if not only or rule in str(only).split("+"):
                        out.append((seed, level, rule))
        return out

    def one(self, seed: int, level: str, rule: str) -> None:
        args, tier = self.args, self.tier
        run = args.out / "runs" / level / rule / f"s{seed}"
        sets, level_plan = run_overrides(args, tier, level, seed)
        try:
            train(args, tier, self.model, rule, sets, level_plan.iterations, run)
            summary = summarize_run(run, level_plan, args, tier)
            if tier is DEMO:
                summary["after"] = stability.evaluate(
                    stability_settings(args), str(run / "checkpoints" / f"step-{level_plan.iterations}" / "actor"),
                    args.out / "eval" / level / rule / f"s{seed}")
        except NotDone:
            with self.lock:
                self.complete = False
            return
        drop_checkpoints(types.SimpleNamespace(keep_checkpoints=args.keep_checkpoints), run)
        with self.lock:
            self.runs.setdefault(level, {}).setdefault(rule, {})[seed] = summary
            print(f"[{time.perf_counter() - self.started:6.0f}s] {level} {rule} s{seed}: "
                  f"{'collapsed at ' + format(summary['collapsed_at'], 'g') if summary['collapsed'] else 'no collapse'}"
                  f"{' (dipped)' if summary['dipped'] else ''}, read-out reward {fmt(summary['reward_last'])}",
                  flush=True)
            if not self.args.report_only:  # a report-only pass writes once, at the end (each write re-reads all)
                self.write(False)

    def run(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(max(1, self.args.jobs)) as pool:
            for future in [pool.submit(self.one, *task) for task in self.tasks()]:
                future.result()
        self.write(self.complete, final=True)

    def write(self, complete: bool, final: bool = False) -> None:
        args, tier = self.args, self.tier
        walls = [r["wall_s"] for lv in self.runs.values() for rl in lv.values() for r in rl.values() if r.get("wall_s")]
        per_iteration = [r["iteration_s"] for lv in self.runs.values() for rl in lv.values() for r in rl.values()
                         if r.get("iteration_s")]
        plans = {n: run_overrides(args, tier, n, 0)[1] for n in self.order}
        runs = {level: dict(sorted(by_rule.items(), key=lambda kv: self.rules.index(kv[0])))
                for level, by_rule in self.runs.items()}
        summary = {
            "tier": tier.name, "tier_description": tier.describe, "quick": args.quick, "warm_start": self.model,
            "init_from": args.init_from, "warm_start_note": self.note, "held_out_before": args.before,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "jobs": args.jobs, "sets": args.sets,
            "command": " ".join(["python", "benchmarks/stress.py", *args.argv]),
            "rules": self.rules, "levels_order": self.order, "levels": {n: args.levels[n] for n in self.order},
            "plans": {n: dataclasses.asdict(p) for n, p in plans.items()}, "seeds": self.seeds,
            "versions": args.versions,
            "common_sets": [s for s in run_overrides(args, tier, self.order[0], 0)[0]
                            if s not in plans[self.order[0]].sets],
            "collapse_criterion": CRITERION, "complete": complete,
            "cells": {level: {rule: cell_summary(r) for rule, r in by_rule.items()} for level, by_rule in runs.items()},
            "comparisons": comparisons(runs, args.levels, self.order, self.rules), "runs": runs,
            "timing": {"runs_wall_s": sum(walls), "runs": len(walls), "run_median_s": statistics.median(walls)
                       if walls else 0.0, "iteration_median_s": statistics.median(per_iteration)
                       if per_iteration else None, "invocation_s": time.perf_counter() - self.started,
                       "load_start": self.load_start, "load_end": os.getloadavg()[0]},
        }
        if summary["cells"] and final:  # drawing it after every run cost seconds a run on a loaded machine
            summary["figure"] = plot(summary, args.out / "figures" / "stress-collapse.png")
        text, report = json.dumps(summary, indent=1, default=str) + "\n", render(summary)
        (args.out / "summary.json").write_text(text)
        (args.out / "report.md").write_text(report)
        # a grid folder serves several selections (--report-only over other levels or rules): each keeps its own
        # copy, so a later selection's report does not replace the one a table was taken from
        kept = args.out / "reports" / selection_name(self.order, self.rules)
        kept.parent.mkdir(exist_ok=True)
        kept.with_suffix(".json").write_text(text)
        kept.with_suffix(".md").write_text(report)


def selection_name(levels, rules) -> str:
    """``lag0+lag16--ppo+st_ppo``: the file name of a selection's kept report."""
    return "+".join(levels) + "--" + "+".join(rules)


if __name__ == "__main__":
    main()
