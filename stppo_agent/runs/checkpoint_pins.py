"""Readers pin the checkpoint they chose, so that a run still training does not prune it under them.

``stppo eval --agent hf:RUN@latest`` while RUN trains picks ``step-N`` and loads it moments later; meanwhile the
trainer may write ``step-N+1`` and prune ``step-N`` (``checkpoint.keep``). So the reader takes a shared lock
(``flock``) on ``RUN/checkpoints/.pins/step-N`` and keeps it for as long as its process lives, or until it picks
another checkpoint of the same run; the trainer takes the exclusive lock before it removes a checkpoint and, when a
reader holds the pin, leaves that checkpoint for a later save to prune. A reader that dies releases its pin with
its process. Nothing is written inside ``step-N`` itself (its manifest vouches for what the run wrote there).

Where locks cannot be taken (a read-only run folder, no ``fcntl``) a reader goes unpinned and
:func:`stppo_agent.runs.run_folder.pick_checkpoint` relies on verifying again and picking again instead.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

try:
    import fcntl
except ImportError:  # not on POSIX: no pins; readers verify and retry
    fcntl = None

PINS = ".pins"
_held: dict[Path, tuple[Path, int]] = {}  # run's checkpoints/ -> (pinned checkpoint, open descriptor)


def _open_pin(folder: Path) -> tuple[Path, int | None]:
    """``folder``'s pin file and a descriptor on it (created if need be); None where locks cannot be taken."""
    path = folder.parent / PINS / folder.name
    if fcntl is None:
        return path, None
    try:
        path.parent.mkdir(exist_ok=True)
        return path, os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:  # a read-only run folder
        return path, None


def pin(folder: Path) -> bool:
    """Hold a shared lock on ``folder``'s pin (releasing this process's earlier pin of the same run); True when
    held, False when ``folder`` went away first or the run folder takes no locks."""
    path, descriptor = _open_pin(folder)
    if descriptor is None:
        return False
    fcntl.flock(descriptor, fcntl.LOCK_SH)  # waits only while the trainer removes this very checkpoint
    try:
        same = os.stat(path).st_ino == os.fstat(descriptor).st_ino
    except FileNotFoundError:
        same = False
    if not same or not folder.is_dir():  # removed between opening the pin and locking it
        os.close(descriptor)
        return False
    earlier = _held.pop(folder.parent, None)
    if earlier is not None:
        os.close(earlier[1])
    _held[folder.parent] = (folder, descriptor)
    return True


def remove_unless_pinned(folder: Path) -> bool:
    """Remove checkpoint ``folder`` unless a reader pins it; True when removed. The trainer's side of :func:`pin`."""
    path, descriptor = _open_pin(folder)
    if descriptor is None:
        shutil.rmtree(folder, ignore_errors=True)
        return True
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(folder, ignore_errors=True)
        path.unlink(missing_ok=True)  # a reader waiting on this pin finds it gone and picks again
        return True
    finally:
        os.close(descriptor)
