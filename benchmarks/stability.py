"""The off-policy stability study of ST-PPO's two mechanisms (turn-level ratios, clip-bias correction).

    python benchmarks/stability.py [--out runs/stability] [--model PATH] [--iterations 2] [--seeds 0,1]
                                   [--live ppo,st_ppo,grpo,so_grpo] [--lr 1e-5] [--eval-limit 16]
                                   [--device cpu|cuda] [--autocast-dtype bfloat16|none] [--quick]
                                   [--report-only]

Parts, each written to OUT/report.md (tables) and OUT/summary.json, figures under OUT/figures/:

1. Warm start: SmolLM2-135M-Instruct after `stppo sft` on the bundled demo set (20 steps, the demo's), unless
   --model names a checkpoint. Evaluated on held-out demo questions per family (general nq, multi-hop hotpotqa,
   medical medqa): the "before" column.
2. Replays: one token-level PPO run is recorded (save_rollouts=true, step diagnostics on) and its batches are
   replayed through turn_ppo, s_ppo and st_ppo (`stppo replay`): same data, four update rules, per-step
   diagnostics. The recorded run is the ppo row (a ppo replay reproduces it exactly; --check-exact runs one
   and reports whether it did).
3. Live runs: each algorithm of --live for each seed, from the same warm start, then evaluated ("after").
   The defaults (2 iterations; live ppo vs st_ppo and grpo vs so_grpo, 2 seeds; turn_ppo and s_ppo through the
   replays) are what fits 2 hours on 2 CPU cores with bfloat16 forwards; all six live is --live
   ppo,turn_ppo,s_ppo,st_ppo,grpo,so_grpo (about 3 hours here, minutes on a GPU with --device cuda).

The regime is off-policy on purpose: per iteration 8 prompts x 4 samples = 32 trajectories of up to 3 turns,
mini-batches of 8 (4 optimizer steps per epoch), 2 PPO epochs: 7 of every 8 optimizer steps are off-policy.
GRPO / SO-GRPO use the 4 samples of a prompt as the group. Everything else is the demo's (format reward 0.2,
48 new tokens per turn, BM25 over the demo corpus). The collapse criterion is stated in the report.

Every part is resumable (a finished run leaves a done marker; rerun the same command after a stop), and
--report-only writes the tables and figures of what is done so far without running anything, also while the
study runs in another process.

--quick runs every part on a tiny random model (a word-level tokenizer over stppo/Toy-v0's words): the warm start
and the evaluations on the demo set (plumbing: the model scores 0 there), and 1 iteration of training and the
replays on stppo/Toy-v0 (16 trajectories of 2 turns of up to 3 tokens, 4 mini-batches x 2 epochs, actor lr 2e-2),
where a random policy earns reward and the off-policy steps clip: real gradients, so the replay-exactness check can
fail. It writes to its own folder (default runs/stability-quick; a folder holding the other kind of run is refused,
so nothing of a quick run is ever reused by a full one) and its report opens with "quick: checks the plumbing, not
a result". 36 s of CPU on this 2-core machine: the `stppo` commands fork from one server that imported torch and
the trainer once (benchmarks/stppo_commands.py), where a new interpreter per command takes 92 s for the same
figures. Run the full study alone on the machine: it is CPU-bound and timings scale with load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import signal
import statistics
import time
from pathlib import Path

import _common  # noqa: F401  (puts the repository on sys.path)
from stability_report import BENCHMARKS, QUICK_BANNER, render
from stppo_commands import run_stppo

from stppo_agent.runs.metrics_log import read_metrics

COLLAPSE = ("a run collapsed if, after its first iteration, its reward fell below half of its running best "
            "(a best of at least 0.1), or its invalid-action rate rose above both 0.5 and twice its first "
            "iteration's, or an update was skipped for NaN/inf")


@dataclasses.dataclass
class Settings:
    out: Path
    model: str | None
    iterations: int
    seeds: list[int]
    live: list[str]
    lr: float
    eval_limit: int
    device: str
    quick: bool
    replay_rules: list[str]
    check_exact: bool
    replay_iterations: int | None = None
    autocast_dtype: str | None = "bfloat16"
    keep_checkpoints: bool = False


QUICK_ENV = "stppo/Toy-v0"  # a tiny random policy earns reward here (a search env gives it none: no gradient)
STUDY_ENV = "stppo/NQ-v0,stppo/HotpotQA-v0,stppo/MedQA-v0"
WARM_START_LIMITS = ("--max-observation-tokens", "160", "--max-total-tokens", "1024")  # as the RL runs cut them


def train_overrides(settings: Settings, seed: int) -> list[str]:
    common = [f"seed={seed}", f"device={settings.device}", "rollout.samples_per_prompt=4", "optimizer.epochs=2",
              f"optimizer.actor_lr={settings.lr}", "optimizer.critic_lr=1e-5", "checkpoint.every=1000",
              "checkpoint.keep=1",
              "logging.progress=false",
              "logging.tensorboard=false", "logging.step_diagnostics=true",
              *([f"precision.autocast_dtype={settings.autocast_dtype}"] if settings.autocast_dtype else [])]
    if settings.quick:  # 16 trajectories in 4 mini-batches x 2 epochs: 7 of 8 steps off-policy, as in the study
        # 3 tokens per turn (the env reads the first word), so that turn-level ratios differ from token-level ones
        return ["rollout.prompts_per_iteration=4", "optimizer.mini_batch_size=4", "optimizer.micro_batch_size=2",
                "rollout.max_turns=2",
                "rollout.max_new_tokens_per_turn=3", "rollout.max_prompt_tokens=8", "rollout.max_total_tokens=32",
                *common]
    return [
        "env_kwargs.split=train", "env_kwargs.format_reward=0.2", "rollout.prompts_per_iteration=8",
        "optimizer.mini_batch_size=8",
        "optimizer.micro_batch_size=4", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=48",
        "rollout.max_observation_tokens=160",
        "rollout.max_prompt_tokens=400", "rollout.max_total_tokens=768", *common,
    ]


class NotDone(Exception):
    """--report-only met a part that has not run (or is running now in another invocation)."""


REPORT_ONLY = False


def stppo(*args: str) -> None:
    """One `stppo` command in its own process (forked, see stppo_commands.py); a failure raises with its output."""
    if REPORT_ONLY:
        raise NotDone(" ".join(args[:2]))
    run_stppo(args)


def warm_start(settings: Settings) -> str:
    if settings.model:
        return settings.model
    target = settings.out / "sft"
    if (target / "sft.json").exists():  # reuse an earlier run's warm start
        return str(target)
    if settings.quick:
        from stppo_agent.models.tiny import build_tiny_llama

        # the toy env's words are the whole vocabulary: a random policy says the target often enough to be paid
        base = build_tiny_llama(settings.out / "tiny")
        stppo("sft", "--model", str(base), "--output-dir", str(target), "--benchmarks", "nq,hotpotqa,medqa",
              "--steps", "2", "--limit", "4", *WARM_START_LIMITS)
    else:
        stppo("sft", "--model", "smollm2", "--output-dir", str(target), "--benchmarks", "nq,hotpotqa,medqa",
              "--steps", "20", "--lr", "5e-5", *WARM_START_LIMITS)
    return str(target)


def evaluate(settings: Settings, model: str, out: Path) -> dict[str, float]:
    """EM (general, multi-hop) or accuracy (medical) on held-out demo questions, greedy, 3 turns."""
    if not (out / "results.json").exists():
        stppo("eval", "--agent", f"hf:{model}", "--benchmarks", ",".join(BENCHMARKS.values()), "--retriever", "demo",
              "--limit", str(settings.eval_limit), "--max-turns", "3", "--max-new-tokens",
              "8" if settings.quick else "48", "--output-dir", str(out))
    results = json.loads((out / "results.json").read_text())
    scores = {r["benchmark"]: r["metrics"].get("em", r["metrics"].get("acc", 0.0)) for r in results}
    return {family: scores[name] for family, name in BENCHMARKS.items()}


def needs_run(out: Path) -> bool:
    """False when ``out`` holds a finished run; otherwise clears it for a fresh one (a run cut mid-way restarts).
    Under --report-only nothing is cleared: another invocation may be writing it."""
    if (out / "done").exists():
        return False
    if REPORT_ONLY:
        raise NotDone(str(out))
    shutil.rmtree(out, ignore_errors=True)
    return True


def train(settings: Settings, model: str, algo: str, seed: int, out: Path, record: bool = False) -> None:
    if not needs_run(out):
        return
    sets = train_overrides(settings, seed) + (["logging.save_rollouts=true"] if record else [])
    stppo("train", "--algo", algo, "--env", QUICK_ENV if settings.quick else STUDY_ENV, "--model", model,
          "--output-dir", str(out), "--iterations", str(settings.iterations),
          *[arg for item in sets for arg in ("--set", item)])
    (out / "done").write_text("")


def replay(recorded: Path, algo: str, out: Path, iterations: int | None = None) -> None:
    if not needs_run(out):
        return
    stppo("replay", str(recorded), "--algo", algo, "--output-dir", str(out), "--set", "logging.progress=false",
          *(["--iterations", str(iterations)] if iterations else []))
    (out / "done").write_text("")


def claim_folder(out: Path, quick: bool) -> None:
    """A quick run and a full study never share a folder, so neither reads the other's warm start, runs or report
    (a full study resumed in a quick run's folder would take its tiny warm start for its own). ``mode.json`` says
    which a folder holds; a folder without one says so in summary.json."""
    held = None
    if (out / "mode.json").exists():
        held = json.loads((out / "mode.json").read_text())["quick"]
    elif (out / "summary.json").exists():
        held = json.loads((out / "summary.json").read_text()).get("settings", {}).get("quick")
    if held is not None and bool(held) != quick:
        kind = "a --quick run (plumbing, not a result)" if held else "a full study"
        raise SystemExit(f"{out} holds {kind}; give this {'--quick run' if quick else 'study'} another --out "
                         f"(default {default_out(quick)})")
    out.mkdir(parents=True, exist_ok=True)
    if not REPORT_ONLY:
        (out / "mode.json").write_text(json.dumps({"quick": quick}) + "\n")


def default_out(quick: bool) -> str:
    return "runs/stability-quick" if quick else "runs/stability"


def drop_checkpoints(settings: Settings, run: Path) -> None:
    """Once a run is evaluated (or replayed) the study needs its metrics, not its weights: a checkpoint with
    AdamW state (and a critic) is 1.6-3.6 GB, 28 GB over the default study -- more than a small disk holds.
    --keep-checkpoints keeps them; the recorded run's rollouts/ (and its initial weights) always stay."""
    if not settings.keep_checkpoints and not REPORT_ONLY:
        shutil.rmtree(run / "checkpoints", ignore_errors=True)


def number(record: dict, key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def summarize(run: Path, iterations: int | None = None) -> dict:
    """The per-run figures of the tables: curves from metrics.jsonl, tails from steps.jsonl (the first
    ``iterations`` only, when given: a replay of fewer iterations is compared with the same span of the run)."""
    records, steps = read_metrics(run), read_metrics(run, "steps.jsonl")
    if iterations is not None:
        records = [r for r in records if r["step"] <= iterations]
        steps = [s for s in steps if s["iteration"] <= iterations]
    rewards = [r["reward"] for r in records]
    best, drawdown, collapsed_at = -math.inf, 0.0, None
    first_invalid = records[0].get("invalid_action_rate", 0.0) if records else 0.0
    for i, (reward, record) in enumerate(zip(rewards, records)):
        best = max(best, reward)
        drawdown = max(drawdown, best - reward)
        invalid = record.get("invalid_action_rate", 0.0)
        if collapsed_at is None and i > 0 and ((best >= 0.1 and reward < best / 2)
                                               or invalid > max(0.5, 2 * first_invalid)
                                               or record.get("skipped", 0) > 0):
            collapsed_at = record["step"]

    def series(key: str) -> list[float]:
        return [v for r in records if (v := number(r, key)) is not None]

    def mean(values):
        return statistics.fmean(values) if values else None

    grad_norms = sorted(s["grad_norm"] for s in steps if isinstance(s.get("grad_norm"), (int, float)))
    off = [s for s in steps if not s.get("on_policy")]
    return {
        "iterations": len(records), "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None, "reward_curve": rewards, "worst_drawdown": drawdown,
        "clip_frac_mean": mean(series("clip_frac")), "clip_frac_max": max(series("clip_frac"), default=None),
        "offpolicy_clip_frac_mean": mean(series("offpolicy/clip_frac")),
        "turn_clip_frac_mean": mean(series("turn_clip_frac")),
        "turn_clip_frac_max": max(series("turn_clip_frac"), default=None),
        "offpolicy_turn_clip_frac_mean": mean(series("offpolicy/turn_clip_frac")),
        "grad_norm_p99": grad_norms[min(len(grad_norms) - 1, int(0.99 * len(grad_norms)))] if grad_norms else None,
        "clip_bias_scale_mean": mean(series("clip_bias_scale")),
        "clip_bias_norm_offpolicy_mean": mean([s["clip_bias_norm"] for s in off if "clip_bias_norm" in s]),
        "ratio_max": max((s["ratio_max"] for s in steps if "ratio_max" in s), default=None),
        "turn_ratio_max": max((s["turn_ratio_max"] for s in steps if "turn_ratio_max" in s), default=None),
        "ratio_p99_offpolicy_mean": mean([s["ratio_p99"] for s in off if "ratio_p99" in s]),
        "grad_cos_offpolicy_mean": mean([s["grad_cos_to_first"] for s in off if "grad_cos_to_first" in s]),
        "kl_to_reference_last": series("kl_to_reference")[-1] if series("kl_to_reference") else None,
        "invalid_action_rate_mean": mean(series("invalid_action_rate")),
        "collapsed_at": collapsed_at,
        "minutes": sum(r.get("iteration_seconds", 0.0) for r in records) / 60,
    }


def plot(runs: list[Path], out: Path) -> list[str]:
    from stppo_agent.runs.plots import plot_runs

    return [str(p) for p in plot_runs([str(r) for r in runs], out)]


def stop_on_sigterm() -> None:
    """``kill`` stops the study and the `stppo` command it is waiting for: SIGTERM becomes SystemExit, on which
    ``run_stppo`` kills the command. (Python's default dies at once and leaves the command running, orphaned,
    still writing its run folder and taking the CPU -- that a resumed study would then train again beside it.)"""
    def exit_now(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_now)


def main() -> None:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help=f"default {default_out(False)}; --quick: {default_out(True)}")
    parser.add_argument("--model", default=None, help="a warm-started checkpoint (default: stppo sft on smollm2)")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--live", default="ppo,st_ppo,grpo,so_grpo",
                        help="algorithms trained live for every seed ('' for replays only); turn_ppo and s_ppo "
                             "go through the replays by default (all six live do not fit 2 hours on 2 CPU cores)")
    parser.add_argument("--lr", type=float, default=None,
                        help="actor learning rate of every run (default 1e-5; --quick: 2e-2, so that steps clip)")
    parser.add_argument("--eval-limit", type=int, default=16, help="held-out questions per benchmark")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast-dtype", default="bfloat16", choices=("bfloat16", "none"),
                        help="forward passes under torch.autocast, float32 weights (2.6x faster on the AMD EPYC the "
                             "study ran on; check benchmarks/precision.py on yours; none: float32)")
    parser.add_argument("--replay-rules", default="turn_ppo,s_ppo,st_ppo",
                        help="rules the recorded ppo run is replayed through")
    parser.add_argument("--check-exact", action="store_true",
                        help="also replay through ppo and report whether it reproduces the recording exactly")
    parser.add_argument("--replay-iterations", type=int, default=None,
                        help="replay only the first N recorded iterations (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 1 iteration, trained and replayed on stppo/Toy-v0 (real gradients)")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: tables and figures of the parts already done (while a study runs, too)")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep every run's checkpoints (1.6-3.6 GB each; by default dropped once evaluated)")
    args = parser.parse_args()
    global REPORT_ONLY
    REPORT_ONLY = args.report_only
    settings = Settings(Path(args.out or default_out(args.quick)), args.model, 1 if args.quick else args.iterations,
                        [int(s) for s in args.seeds.split(",") if s.strip()][: 1 if args.quick else None],
                        [a.strip() for a in args.live.split(",") if a.strip()],
                        args.lr if args.lr is not None else 2e-2 if args.quick else 1e-5,
                        2 if args.quick else args.eval_limit, args.device, args.quick,
                        [a.strip() for a in args.replay_rules.split(",") if a.strip()],
                        args.check_exact or args.quick, args.replay_iterations,
                        None if args.autocast_dtype == "none" else args.autocast_dtype, args.keep_checkpoints)
    if args.quick:
        settings.live = [a for a in settings.live if a in ("ppo", "st_ppo")]
    claim_folder(settings.out, args.quick)
    started = time.perf_counter()
    timings: dict[str, float] = {}

    def timed(name: str, fn, *a):
        t0 = time.perf_counter()
        value = fn(*a)
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
        print(f"[{time.perf_counter() - started:7.0f}s] done: {name} ({(time.perf_counter() - t0) / 60:.1f} min)",
              flush=True)
        return value

    model = timed("warm start", warm_start, settings)
    before = timed("evaluate warm start", evaluate, settings, model, settings.out / "eval" / "warm-start")

    recorded = settings.out / "live" / f"ppo-s{settings.seeds[0]}"
    try:
        timed("record ppo", train, settings, model, "ppo", settings.seeds[0], recorded, True)
    except NotDone:
        raise SystemExit(f"--report-only: the recorded ppo run ({recorded}) is not done yet; nothing to report")
    span = settings.replay_iterations
    replays = {"ppo": summarize(recorded, span)}  # the recorded run is the ppo rule on its own data
    replay_dirs = {"ppo": recorded}
    for algo in settings.replay_rules + (["ppo"] if settings.check_exact else []):
        target = settings.out / "replay" / algo
        try:
            timed(f"replay {algo}", replay, recorded, algo, target, span)
        except NotDone:
            continue
        drop_checkpoints(settings, target)
        if algo != "ppo":
            replays[algo], replay_dirs[algo] = summarize(target, span), target
    exact = None
    if settings.check_exact and (settings.out / "replay" / "ppo" / "done").exists():
        original = read_metrics(recorded)[:span]
        again = read_metrics(settings.out / "replay" / "ppo")
        timing_keys = {"rollout_seconds", "iteration_seconds", "rollout_tokens_per_s", "update_tokens_per_s"}
        exact = len(original) == len(again) and all(
            all(a[k] == b.get(k) for k in a if k not in timing_keys) for a, b in zip(original, again))

    live: dict[str, dict[int, dict]] = {}
    figures: dict[str, list[str]] = {}

    def write_report(final: bool) -> None:
        """Tables so far (a long study that is stopped still leaves what it measured; rerun to resume it)."""
        total = time.perf_counter() - started
        summary = {"settings": {k: str(v) if isinstance(v, Path) else v
                                for k, v in dataclasses.asdict(settings).items()},
                   "train_overrides": train_overrides(settings, 0), "before": before, "replays": replays,
                   "replay_reproduces_recording": exact, "live": live, "figures": figures, "timings_s": timings,
                   "total_s": total, "collapse_criterion": COLLAPSE, "complete": final}
        (settings.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (settings.out / "report.md").write_text(render(summary))

    write_report(final=False)
    # Seed by seed, every algorithm of a seed before the next seed: a study stopped early (they take hours on a
    # CPU) leaves whole comparisons. The recorded run is live ppo's first seed.
    algos = list(dict.fromkeys(["ppo", *settings.live]))
    for seed in settings.seeds:
        for algo in [a for a in algos if a in settings.live or seed == settings.seeds[0]]:
            run = settings.out / "live" / f"{algo}-s{seed}"
            try:
                timed(f"train {algo} seed {seed}", train, settings, model, algo, seed, run, False)
                summary = summarize(run)
                summary["after"] = timed(f"evaluate {algo} seed {seed}", evaluate, settings,
                                         str(run / "checkpoints" / f"step-{settings.iterations}" / "actor"),
                                         settings.out / "eval" / f"{algo}-s{seed}")
            except NotDone:
                continue
            drop_checkpoints(settings, run)
            live.setdefault(algo, {})[seed] = summary
            write_report(final=False)

    figures["replay"] = timed("plot replays", plot, list(replay_dirs.values()), settings.out / "figures" / "replay")
    if live:
        figures["live"] = timed("plot live runs", plot, [settings.out / "live" / f"{a}-s{s}" for a in live
                                                         for s in live[a]], settings.out / "figures" / "live")
    write_report(final=not REPORT_ONLY or all(
        (settings.out / "live" / f"{a}-s{s}" / "done").exists() for s in settings.seeds for a in settings.live))
    print((settings.out / "report.md").read_text())
    print(f"total {(time.perf_counter() - started) / 60:.1f} min; report {settings.out / 'report.md'}"
          + (f" ({QUICK_BANNER.split(' (')[0]})" if settings.quick else ""))


if __name__ == "__main__":
    main()
