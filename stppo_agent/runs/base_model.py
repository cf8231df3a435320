"""Which base model a run was trained from, by its weights: a checkpoint records their sha256
(``model_sha256`` in ``trainer_state.json``), so a resume accepts a moved copy of the same model -- the folder
renamed, ``STPPO_CACHE_DIR`` changed, ``--model tiny`` built again elsewhere -- and refuses other weights.

The hash covers the folder's weight files (``*.safetensors``, ``*.bin``), names and bytes; it is computed once per
process and folder (seconds for a 3B model), when the first checkpoint is written and when a resume names another
folder. A hub name has none: it cannot move.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any, Callable, Mapping

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def weights_sha256(model: str | None) -> str | None:
    """sha256 over ``model``'s weight files, or None when it is not a local folder holding some."""
    folder = Path(str(model)).expanduser() if model else None
    if folder is None or not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        return None
    return _hash(tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


@functools.lru_cache(maxsize=8)
def _hash(files: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for path, _, _ in files:
        digest.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _is_local(model: str) -> bool:
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


def reconcile(previous: Mapping[str, Any], current: Mapping[str, Any], recorded: str | None, needed: bool,
              report: Callable[[str], None] | None = None) -> Mapping[str, Any]:
    """``previous`` (the checkpoint's config) with its ``model`` replaced by ``current``'s when that is a copy of
    the same weights (``recorded``: the checkpoint's ``model_sha256``), so that
    :func:`stppo_agent.runs.resume_settings.check` sees no change. ValueError (one line) when the model the resume
    would load (``needed``: a KL reference; otherwise the actor and tokenizer come from the checkpoint) no longer
    exists, or when another folder is named that holds other weights."""
    old, new = previous.get("model"), current.get("model")
    if not isinstance(old, str) or not isinstance(new, str):
        return previous
    known = f" (sha256 {recorded[:16]}...)" if recorded else ""
    if _is_local(new) and not Path(new).expanduser().exists() and (needed or new != old):
        said = "this run's config.yaml names it" if new == old else "--model names it"
        raise ValueError(f"--resume: the base model {new} does not exist ({said}; moved, or STPPO_CACHE_DIR "
                         f"changed?): pass --model with the folder it is in now, a copy of the same weights{known}")
    if new == old or recorded is None:
        return previous  # unchanged, or a checkpoint from before hashes: resume_settings decides
    found = weights_sha256(new)
    if found != recorded:
        what = f"its weights' sha256 is {found[:16]}..." if found else "it holds no weight files to compare"
        raise ValueError(f"--resume cannot change model ({old} -> {new}): {new} is not a copy of the model this run "
                         f"was trained from ({what}, the run's is {recorded[:16]}...). Pass --model with a copy of "
                         "that model, or start a new run in another --output-dir")
    if report is not None:
        report(f"base model {new}: the same weights as {old}{known}, which this run was trained from")
    return {**previous, "model": new}
