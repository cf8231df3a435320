"""What a trainer may do with its run folder: start a new run, continue one, or replace one -- never mix two.

A folder *holds a run* when it has metrics or checkpoints. Then:

- without ``--resume`` or ``--overwrite``: refused (a new run would wipe ``metrics.jsonl``, and pruning by step
  would keep the old run's higher-numbered checkpoints over the new run's);
- ``--overwrite``: the old run's files are removed first;
- ``--resume``: continues from the newest checkpoint that verifies. Newer checkpoints that do not verify are moved
  aside to ``checkpoints/.corrupt-step-N`` (kept for inspection, never pruned over the resumed run's). When no
  checkpoint verifies, the run stops and says what it found: starting over would mix two runs in one folder.

No run, and no other output of a stppo command, goes inside a run's ``checkpoints/step-N``
(:func:`refuse_inside_checkpoint`): a checkpoint holds what its run wrote there and nothing else.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Callable

from stppo_agent.runs.checkpoint import (
    CorruptCheckpointError,
    list_checkpoints,
    set_aside,
    valid_checkpoints,
    verify_checkpoint,
)
from stppo_agent.runs.checkpoint_pins import pin

RUN_FILES = ("metrics.jsonl", "steps.jsonl", "checkpoints", "rollouts", "tensorboard", "config.yaml", "replay.json")


def holds_run(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() or bool(list_checkpoints(run_dir))


def describe(run_dir: Path) -> str:
    steps = list_checkpoints(run_dir)
    metrics = run_dir / "metrics.jsonl"
    records = sum(1 for line in metrics.read_text(errors="replace").splitlines() if line.strip()) \
        if metrics.exists() else 0
    return f"{len(steps)} checkpoint(s){' (steps ' + ', '.join(map(str, steps)) + ')' if steps else ''}, " \
           f"{records} metrics record(s)"


def prepare(run_dir: Path, *, resume: bool, overwrite: bool, report: Callable[[str], None] = print) -> Path | None:
    """Check the folder against the intent; return the checkpoint to resume from (None: start fresh)."""
    if resume and overwrite:
        raise ValueError("--resume continues the run in the folder and --overwrite replaces it: pass one")
    refuse_inside_checkpoint(run_dir, "the run folder (output_dir)")
    if run_dir.exists() and not run_dir.is_dir():
        raise FileExistsError(f"output dir {run_dir} is a file")
    if not holds_run(run_dir):
        if resume:
            report(f"--resume: {run_dir} holds no run yet; starting one")
        return None
    if overwrite:
        report(f"--overwrite: removing the run in {run_dir} ({describe(run_dir)})")
        for name in RUN_FILES:
            target = run_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        return None
    if not resume:
        raise FileExistsError(f"{run_dir} already holds a run ({describe(run_dir)}); pass --resume to continue it, "
                              "--overwrite to replace it, or choose another --output-dir")
    return _newest_valid(run_dir, report)


def _newest_valid(run_dir: Path, report: Callable[[str], None]) -> Path:
    problems = []
    for step in reversed(list_checkpoints(run_dir)):
        folder = run_dir / "checkpoints" / f"step-{step}"
        try:
            verify_checkpoint(folder)
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
            aside = set_aside(folder, "corrupt")
            report(f"skipping corrupt checkpoint (moved to {aside.name}): {exc}")
            continue
        return folder
    found = "; ".join(problems) or "no checkpoint at all (the run stopped before its first save)"
    raise CorruptCheckpointError(
        f"--resume: nothing in {run_dir} can be resumed: {found}. Starting over would mix two runs in one folder: "
        "pass --overwrite to start again there, or another --output-dir")


def prepare_on_all_ranks(run_dir: Path, *, resume: bool, overwrite: bool,
                         report: Callable[[str], None] = print) -> Path | None:
    """:func:`prepare` on the first process only (it may move or remove files); every rank gets its verdict."""
    from stppo_agent.distributed import process_group

    outcome: object = None
    if process_group.is_main():
        try:
            outcome = prepare(run_dir, resume=resume, overwrite=overwrite, report=report)
        except (FileExistsError, ValueError, CorruptCheckpointError) as exc:
            outcome = exc
    outcome = process_group.all_gather_objects(outcome)[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


CHECKPOINT_CHOICES = ("latest", "best", "healthy")
_STEP_FOLDER = re.compile(r"^\.?step-\d+(\.tmp)?$")


def refuse_inside_checkpoint(path: str | Path, what: str = "--output-dir") -> None:
    """ValueError (one line) when ``path`` lies in a run's ``checkpoints/step-N`` (or its scratch copy): what a
    checkpoint holds is its manifest's, and whatever a command wrote there would go with it when it is pruned."""
    resolved = Path(path).expanduser().absolute()
    for folder in (resolved, *resolved.parents):
        if _STEP_FOLDER.match(folder.name) and folder.parent.name == "checkpoints":
            run = folder.parent.parent
            raise ValueError(f"{what} {path} is inside checkpoint {folder.name} of the run {run}: a checkpoint holds "
                             f"what its run wrote and nothing else. Write to another folder, e.g. {run / 'eval'}")


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and (path / "checkpoints").is_dir() and not (path / "config.json").exists()


def pick_checkpoint(run_dir: Path, which: str = "latest") -> tuple[Path, str]:
    """A checkpoint of a run, by name: ``latest`` (newest that verifies), ``healthy`` (newest known-healthy),
    ``best`` (the healthy one whose weights sampled the highest training reward; see
    stppo_agent/runs/checkpoint_health.py), or a step number. Returns the checkpoint folder and a line saying why it
    was chosen.

    A run trained without the collapse monitor (``monitor.on_collapse=none``) has no ``healthy`` checkpoint (nothing
    judged one), and its ``best`` is the kept checkpoint whose weights sampled the highest training reward, health
    unknown (the reason line says so).

    The run may be training meanwhile: the chosen checkpoint is pinned (:mod:`stppo_agent.runs.checkpoint_pins`),
    so that its trainer does not prune it before this process has loaded it, and verified again once pinned; one
    pruned before it could be pinned is chosen again."""
    for _ in range(5):
        folder, why = _choose(run_dir, which)
        pin(folder)  # best effort: a run folder that takes no locks is only verified again
        try:
            verify_checkpoint(folder)
        except CorruptCheckpointError:
            continue  # pruned between the choice and the pin
        return folder, why
    raise FileNotFoundError(f"{run_dir}@{which}: its checkpoints kept changing while being read (a run writing and "
                            "pruning them faster than they can be verified?); try again")


def _choose(run_dir: Path, which: str) -> tuple[Path, str]:
    from stppo_agent.runs.checkpoint_health import best_step, healthy_steps, monitored
    from stppo_agent.runs.metrics_log import read_metrics

    if which == "latest":
        return _newest_verifying(run_dir)
    steps = valid_checkpoints(run_dir)
    if not steps:
        raise FileNotFoundError(f"{run_dir} has no checkpoint that verifies")
    if which.isdigit() and int(which) in steps:
        return run_dir / "checkpoints" / f"step-{int(which)}", f"step-{int(which)}: as asked"
    if which not in ("best", "healthy"):
        raise ValueError(f"{run_dir}@{which}: choose @latest, @best, @healthy or one of the steps "
                         f"{', '.join(map(str, steps))}")
    records = read_metrics(run_dir)
    if records and not monitored(records):
        if which == "healthy":
            raise FileNotFoundError(f"{run_dir} was trained with monitor.on_collapse=none: no collapse monitor judged "
                                    "its iterations, so no checkpoint is known healthy. Use @best, @latest or @STEP")
        chosen = best_step(records, steps, healthy_only=False)
        if chosen is None:
            raise FileNotFoundError(f"{run_dir}: no kept checkpoint has a logged training reward. Use @latest or @STEP")
        why = (f"the checkpoint with the highest training reward ({_score(records, chosen)}); the run was not "
               "monitored (monitor.on_collapse=none), so its health is unknown")
        return run_dir / "checkpoints" / f"step-{chosen}", f"step-{chosen}: {why}"
    healthy = healthy_steps(records, steps)
    chosen = best_step(records, steps) if which == "best" else (healthy[-1] if healthy else None)
    if chosen is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint is known healthy (kept: steps "
                                f"{', '.join(map(str, steps))}); a healthy one needs its iteration and the one its "
                                "weights sampled logged without a collapse signal. Use @latest or @STEP")
    why = (f"the healthy checkpoint with the highest training reward ({_score(records, chosen)})" if which == "best"
           else "the newest healthy checkpoint")
    return run_dir / "checkpoints" / f"step-{chosen}", f"step-{chosen}: {why}"


def _score(records, step: int) -> str:
    """``0.480, iteration 15's rollouts: its weights sampled``: the reward and where it comes from."""
    from stppo_agent.runs.checkpoint_health import checkpoint_score

    reward, iteration = checkpoint_score(records, step)
    source = "its weights sampled" if iteration != step else \
        "the iteration that made its weights, which sampled none before the run ended"
    return f"{reward:.3f}, iteration {iteration}'s rollouts: {source}"


def _newest_verifying(run_dir: Path) -> tuple[Path, str]:
    """The newest checkpoint that verifies, and why (naming the newer ones that did not)."""
    skipped = []
    for step in reversed(list_checkpoints(run_dir)):
        folder = run_dir / "checkpoints" / f"step-{step}"
        try:
            verify_checkpoint(folder)
        except CorruptCheckpointError:
            if folder.is_dir():  # one pruned meanwhile is no news
                skipped.append(f"step-{step}")
            continue
        why = "the newest checkpoint" if not skipped else \
            f"the newest checkpoint that verifies (the newer {', '.join(skipped)} do{'es' * (len(skipped) == 1)} not)"
        return folder, f"step-{step}: {why}"
    raise FileNotFoundError(f"{run_dir} has no checkpoint that verifies")
