"""What a trainer may do with its run folder: start a new run, continue one, or replace one -- never mix two.

A folder *holds a run* when it has metrics or checkpoints. Then:

- without ``--resume`` or ``--overwrite``: refused (a new run would wipe ``metrics.jsonl``, and pruning by step
  would keep the old run's higher-numbered checkpoints over the new run's);
- ``--overwrite``: the old run's files are removed first;
- ``--resume``: continues from the newest checkpoint that verifies. Newer checkpoints that do not verify are moved
  aside to ``checkpoints/.corrupt-step-N`` (kept for inspection, never pruned over the resumed run's). When no
  checkpoint verifies, the run stops and says what it found: starting over would mix two runs in one folder.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from .checkpoint import CorruptCheckpointError, list_checkpoints, verify_checkpoint

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
            aside = folder.with_name(f".corrupt-step-{step}")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(folder, aside)
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
    from . import distributed

    outcome: object = None
    if distributed.is_main():
        try:
            outcome = prepare(run_dir, resume=resume, overwrite=overwrite, report=report)
        except (FileExistsError, ValueError, CorruptCheckpointError) as exc:
            outcome = exc
    outcome = distributed.all_gather_objects(outcome)[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
