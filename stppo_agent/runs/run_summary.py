"""What ``stppo train`` and ``stppo replay`` say when they end: a few lines read back from the run folder.

The reward's first, best and last iteration, the clip and correction figures of the run's own rule (turn-level
clipping for turn ratios, the clip-bias correction's scale where it is on, the rollout correction where it acts),
collapse alarms, the newest checkpoint and the command that evaluates it, and the folder's size on disk. Every
figure of every iteration stays in ``metrics.jsonl``; ``--json`` prints the last iteration's instead of this.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any, Sequence

import yaml

from stppo_agent.runs.checkpoint import list_checkpoints
from stppo_agent.runs.config_yaml import NumberLoader, migrate_flat
from stppo_agent.runs.metrics_log import read_metrics


def human_bytes(size: float) -> str:
    """``1536000`` -> ``1.5 MB`` (decimal units, as ``du --si`` and disk vendors count)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        shown = f"{size:.0f}" if unit == "B" else f"{size:.1f}"
        if float(shown) < 1000 or unit == "TB":  # as shown: 999,999 B is 1.0 MB, not 1000.0 kB
            return f"{shown} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def _numbers(records: Sequence[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(iteration, value) of the records that hold ``key`` as a finite number."""
    return [(int(r["step"]), float(r[key])) for r in records
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]


def reward_line(records: Sequence[dict[str, Any]]) -> str:
    rewards = _numbers(records, "reward")
    if not rewards:
        return "no iteration recorded a reward"
    (first_step, first), (last_step, last) = rewards[0], rewards[-1]
    best_step, best = max(rewards, key=lambda item: (item[1], -item[0]))  # the earliest of equal bests
    return f"{first:.3f} (iteration {first_step}) -> best {best:.3f} (iteration {best_step}) -> {last:.3f} " \
           f"(iteration {last_step})"


def _span(records, key: str, label: str) -> str | None:
    values = _numbers(records, key)
    if not values:
        return None
    return f"{label} {values[0][1]:.3f} -> {values[-1][1]:.3f} (max {max(v for _, v in values):.3f})"


def clipping_line(records: Sequence[dict[str, Any]], algorithm: dict[str, Any]) -> str:
    """The figures the rule acts on: clipping at its ratio level, then its corrections."""
    level = algorithm.get("ratio_level", "token")
    parts = [_span(records, "turn_clip_frac" if level == "turn" else "clip_frac", f"{level} clip share")]
    if algorithm.get("clip_bias_correction"):
        parts.append(_span(records, "clip_bias_scale", "clip-bias correction scale"))
    for key, label in (("rollout_correction/truncated_frac", "rollout-correction truncated share"),
                       ("rollout_correction/masked_frac", "rollout-correction masked share")):
        if any(value > 0 for _, value in _numbers(records, key)):
            parts.append(_span(records, key, label))
    return "; ".join(p for p in parts if p) or "no clipping figures recorded"


def alarms_line(records: Sequence[dict[str, Any]]) -> str:
    alarms = [int(r["step"]) for r in records if r.get("collapse/alarm")]
    rollbacks = [r["collapse/rollback_to"] for r in records if "collapse/rollback_to" in r]
    skipped = max((value for _, value in _numbers(records, "nan_skips_total")), default=0)
    parts = [f"collapse alarm at iteration {', '.join(map(str, alarms))}" if alarms else "no collapse alarm"]
    if rollbacks:
        parts.append(f"rolled back to step {', '.join(map(str, rollbacks))}")
    if skipped:
        parts.append(f"{skipped:.0f} update(s) skipped for NaN/inf")
    return "; ".join(parts)


# env_kwargs that change what an episode shows the model, which `stppo eval` has no option for, with the envs'
# defaults (what stppo eval uses)
PROMPT_KWARGS = {"template": None, "mcq_template": None, "question_mark": True, "family": None}


def eval_command(run_dir: str, config: dict[str, Any]) -> str:
    """The ``stppo eval`` line for the run's newest checkpoint, on the benchmarks it trained on (a run on other
    envs, such as stppo/Toy-v0, gets nq on the demo set: an eval needs a benchmark) and their data (the evaluation
    split of it), searched as in training (retriever, top-k), under the rollout limits it trained with (turns,
    tokens per turn, the observation cut)."""
    import stppo_envs

    by_env = {stppo_envs.env_id(name): name for name in stppo_envs.BENCHMARKS}
    trained = [by_env[e.strip()] for e in str(config.get("env", "")).split(",") if e.strip() in by_env]
    words = ["stppo", "eval", "--agent", f"hf:{run_dir}@latest", "--benchmarks", ",".join(trained or ["nq"])]
    env_kwargs = config.get("env_kwargs") or {}
    if isinstance(env_kwargs.get("dataset"), str) and env_kwargs["dataset"]:
        for benchmark in trained:  # training shares one dataset across its envs
            words += ["--dataset", f"{benchmark}={env_kwargs['dataset']}"]
    rollout = migrate_flat(config)[0].get("rollout") or {}  # a run folder of an earlier version: the flat names
    settings = [("--retriever", env_kwargs, "retriever"), ("--topk", env_kwargs, "topk"),
                ("--max-turns", rollout, "max_turns"), ("--max-new-tokens", rollout, "max_new_tokens_per_turn"),
                ("--max-observation-tokens", rollout, "max_observation_tokens")]
    for flag, source, key in settings:
        value = source.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            words += [flag, str(value)]
    words += ["--output-dir", str(Path(run_dir) / "eval")]
    return shlex.join(words)


def eval_caveat(config: dict[str, Any]) -> str | None:
    """What the ``stppo eval`` line cannot reproduce of the run's episodes, if anything."""
    env_kwargs = config.get("env_kwargs") or {}
    unmatched = [key for key, default in PROMPT_KWARGS.items() if env_kwargs.get(key, default) != default]
    if not unmatched:
        return None
    return (f"the run set env_kwargs {', '.join(unmatched)}, which stppo eval does not take: it evaluates with the "
            "default prompts")


def run_summary(run_dir: str | Path, title: str = "run") -> str:
    """The summary of the run folder ``run_dir`` (as the user typed it: the commands shown reuse it)."""
    run_dir = str(run_dir)
    folder = Path(run_dir)
    records = read_metrics(folder)
    config_path = folder / "config.yaml"
    config = yaml.load(config_path.read_text(), Loader=NumberLoader) if config_path.exists() else {}
    config = config if isinstance(config, dict) else {}
    steps = [int(r["step"]) for r in records if "step" in r]
    span = f"iterations {steps[0]}-{steps[-1]}" if steps else "no iteration recorded"
    lines = [f"{title} {run_dir}: {config.get('algo', '?')} on {config.get('env', '?')}, {span}",
             f"  reward      {reward_line(records)}",
             f"  clipping    {clipping_line(records, config.get('algorithm') or {})}",
             f"  alarms      {alarms_line(records)}"]
    checkpoints = list_checkpoints(folder)
    if checkpoints:
        newest = folder / "checkpoints" / f"step-{checkpoints[-1]}"
        kept = f"; {len(checkpoints)} kept" if len(checkpoints) > 1 else ""
        lines += [f"  checkpoint  {Path(run_dir) / 'checkpoints' / newest.name} "
                  f"({human_bytes(folder_bytes(newest))}{kept})",
                  f"  evaluate    {eval_command(run_dir, config)}"]
        caveat = eval_caveat(config)
        lines += [f"              ({caveat})"] if caveat else []
    else:
        lines.append("  checkpoint  none written")
    steps_file = " (each optimizer step's: steps.jsonl)" if (folder / "steps.jsonl").exists() else ""
    lines.append(f"  run folder  {run_dir}: {human_bytes(folder_bytes(folder))} on disk; every iteration's figures in "
                 f"metrics.jsonl{steps_file}")
    return "\n".join(lines)
