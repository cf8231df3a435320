"""Checkpoints as Hugging Face folders plus trainer state, written atomically and verified before loading.

    checkpoints/step-N/
      actor/              save_pretrained (safetensors) + tokenizer: AutoModelForCausalLM.from_pretrained works;
                          config.json states the dtype the weights are stored in
      critic/             AutoModelForTokenClassification folder (PPO family only)
      optimizer_state.pt  the actor's and critic's AdamW moments (8 bytes per parameter in float32)
      lagged_policy.safetensors  rollout_staleness K > 0 only: K copies of the actor's weights, what continues the
                          lag on resume (stppo_agent/runs/lagged_weights.py)
      trainer_state.pt    scheduler state, torch RNG (torch.load(weights_only=True))
      trainer_state.json  iteration, data position, python/numpy RNG, counters (human-readable)
      manifest.json       sha256 and size of every file above, written last

A checkpoint is written into a hidden temporary folder and renamed into place, so a crash never leaves a
half-written ``step-N``. On resume, the newest checkpoint whose manifest verifies is used; a corrupt one is
reported and skipped, never loaded. Nothing is unpickled: weights are safetensors, state is weights_only.
Verification checks the files the manifest names, plus that it names every file a loader reads whatever the
manifest says (the trainer state, and the model folders' weights, configs and tokenizer files): a file someone
else put in the folder (notes, an evaluation's output) is not the checkpoint's and does not make it corrupt. No
stppo command writes there (:func:`stppo_agent.runs.run_folder.refuse_inside_checkpoint`).

Disk (the run's config, read from the checkpoint's own record of it): ``checkpoint.dtype=bfloat16`` writes the
weights, critic and lagged copies included, in bfloat16 (half of float32; resume continues from the rounded
weights; ``float16`` too, refused for a weight beyond its range), and ``checkpoint.optimizer=newest`` keeps what
only a resume reads (the optimizer state, the lagged copies) in the newest checkpoint only: an older one drops it
(manifest entry first, then the file) once a newer one is complete, so a kill -9 at any moment leaves the newest
checkpoint whole and the older ones verifying; ``checkpoint.optimizer=none`` never writes them (verl's
``save_contents: [model]``): checkpoints to evaluate or to start a new run from, not to resume.
(monitor.on_collapse=rollback restores an older checkpoint's optimizer state, so it needs checkpoint.optimizer=all.)
Pruning skips a checkpoint a reader has pinned (:mod:`stppo_agent.runs.checkpoint_pins`); a later save prunes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Collection

import torch

from stppo_agent.runs.checkpoint_pins import remove_unless_pinned
from stppo_agent.runs.config_yaml import migrate_flat
from stppo_agent.runs.lagged_weights import LAGGED_FILE, load_lagged, save_lagged
from stppo_envs.suggest import did_you_mean

_STEP = re.compile(r"^step-(\d+)$")
OPTIMIZER_FILE = "optimizer_state.pt"
OPTIMIZER_KEYS = ("actor_optimizer", "critic_optimizer")  # the tensor-state entries that go to OPTIMIZER_FILE
RESUME_FILES = (OPTIMIZER_FILE, LAGGED_FILE)  # read by a resume or rollback only, and only when the manifest lists them
STATE_FILES = ("trainer_state.json", "trainer_state.pt")  # read whenever the checkpoint is
MODEL_FOLDERS = ("actor", "critic")
# what a Hugging Face loader may read from a model folder, listed or not: weights, configs, tokenizer files
LOADER_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt", ".jinja", ".tiktoken", ".py", ".h5", ".msgpack")
CHECKPOINT_OPTIMIZER = ("all", "newest", "none")
CHECKPOINT_DTYPES = ("bfloat16", "float16", "float32")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, mostly); nothing older was touched."""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's files do not match its manifest (or it has none)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = {str(p.relative_to(folder)): {"sha256": _sha256(p), "bytes": p.stat().st_size}
             for p in sorted(folder.rglob("*")) if p.is_file()}
    (folder / "manifest.json").write_text(json.dumps(files, indent=1, sort_keys=True))


def verify_checkpoint(folder: Path) -> None:
    """Raise :class:`CorruptCheckpointError` unless every file ``manifest.json`` names matches it and it names
    every file a loader reads. A checkpoint removed while being read (pruned by the running trainer) is corrupt
    too; one whose manifest changed meanwhile (an older checkpoint dropping its optimizer state) is read again."""
    for _ in range(3):
        manifest = None
        try:
            manifest = _read_manifest(folder)
            _check_files(folder, manifest)
            return
        except (CorruptCheckpointError, FileNotFoundError, NotADirectoryError) as exc:
            if not folder.is_dir():
                raise CorruptCheckpointError(f"{folder} was removed while being read (pruned by the run that "
                                             "wrote it?)") from exc
            if manifest is not None and _read_manifest(folder) != manifest:
                continue  # rewritten meanwhile: read again
            if isinstance(exc, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(f"{folder}: {exc.filename} vanished while being read") from exc
    raise CorruptCheckpointError(f"{folder}/manifest.json kept changing while the checkpoint was read")


def _read_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    manifest_path = folder / "manifest.json"
    if not manifest_path.exists():
        raise CorruptCheckpointError(f"{folder} has no manifest.json (an interrupted or foreign write)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{folder}/manifest.json is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or not all(isinstance(v, dict) and {"sha256", "bytes"} <= set(v)
                                                 for v in manifest.values()):
        raise CorruptCheckpointError(f"{folder}/manifest.json is not a mapping of file -> {{sha256, bytes}}")
    return manifest


def _loaded_files(folder: Path) -> set[str]:
    """The files loading this checkpoint reads whether or not the manifest lists them."""
    found = {name for name in STATE_FILES if (folder / name).is_file()}
    for model in MODEL_FOLDERS:
        if (folder / model).is_dir():
            found |= {f"{model}/{p.name}" for p in (folder / model).iterdir()
                      if p.is_file() and p.name.endswith(LOADER_SUFFIXES)}
    return found


def _check_files(folder: Path, manifest: dict[str, dict[str, Any]]) -> None:
    unlisted = sorted(_loaded_files(folder) - set(manifest))
    if unlisted or not manifest:  # a manifest must vouch for what loads, or truncated weights would
        raise CorruptCheckpointError(f"{folder}/manifest.json does not list {', '.join(unlisted) or 'any file'}")
    for name, expected in manifest.items():
        path = folder / name
        if not path.exists():
            raise CorruptCheckpointError(f"{folder}: {name} is missing")
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            raise CorruptCheckpointError(f"{folder}: {name} does not match its checksum (corrupt or edited)")


def save_checkpoint(run_dir: Path, step: int, *, actor, tokenizer, critic, tensor_state: dict[str, Any],
                    json_state: dict[str, Any], keep: int, actor_state: dict | None = None,
                    critic_state: dict | None = None, protect: Collection[int] = ()) -> Path:
    """Write ``checkpoints/step-{step}`` atomically; prune to the ``keep`` newest, except the steps in
    ``protect`` (a known-healthy and a best checkpoint). ``actor_state`` / ``critic_state``: full state dicts to
    write instead of the modules' own (gathered from FSDP2 shards)."""
    from stppo_agent.models.loading import save_policy

    settings = json_state.get("config") or {}  # the run's config as the checkpoint records it
    checkpointing = settings.get("checkpoint") or {}
    dtype, optimizer_policy = checkpointing.get("dtype"), checkpointing.get("optimizer") or "all"
    check_checkpoint_settings(dtype, optimizer_policy, (settings.get("monitor") or {}).get("on_collapse"))
    lagged = tensor_state.get("stale_policy") or {}
    if dtype is not None:
        actor_state = _for_disk(actor_state if actor_state is not None else actor.state_dict(), dtype, "actor")
        if critic is not None:
            critic_state = _for_disk(critic_state if critic_state is not None else critic.state_dict(), dtype,
                                     "critic")
        for entry in (lagged.get("model", {}), *lagged.get("pending", ())):
            _check_range(entry, dtype, "lagged policy")  # save_lagged converts it
    optimizer_state = {k: v for k, v in tensor_state.items() if k in OPTIMIZER_KEYS}
    if optimizer_policy == "none":  # what only a resume reads is not written at all
        optimizer_state, lagged = {}, {}
    tensor_state = {k: v for k, v in tensor_state.items() if k not in (*OPTIMIZER_KEYS, "stale_policy")}
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    scratch = root / f".step-{step}.tmp"
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir()
    try:
        save_policy(scratch, actor, tokenizer, critic, actor_state, critic_state)
        if dtype is not None:
            _record_dtype(scratch, dtype)
        torch.save(tensor_state, scratch / "trainer_state.pt")
        if optimizer_state:
            torch.save(optimizer_state, scratch / OPTIMIZER_FILE)
        if lagged:
            save_lagged(scratch / LAGGED_FILE, lagged, dtype)
        (scratch / "trainer_state.json").write_text(json.dumps(json_state, indent=1, sort_keys=True))
        _write_manifest(scratch)
    except Exception as exc:  # a full disk surfaces as OSError, or as safetensors' / torch's own error types
        shutil.rmtree(scratch, ignore_errors=True)  # the partial copy would only hold on to the space
        latest = max(list_checkpoints(run_dir), default=None)
        kept = f"the newest complete checkpoint, step-{latest}, is intact" if latest is not None else \
            "no complete checkpoint exists yet"
        raise CheckpointWriteError(
            f"could not write checkpoint {final}: {' '.join(str(exc).split())}. The partial copy was removed and "
            f"{kept}: free disk space (or lower checkpoint.keep), then rerun with --resume") from exc
    if final.exists():
        shutil.rmtree(final)
    os.replace(scratch, final)
    _fsync_dir(root)
    for old in sorted(list_checkpoints(run_dir))[:-keep]:
        if old not in protect:
            remove_unless_pinned(root / f"step-{old}")  # a pinned one: a later save prunes it
    if optimizer_policy == "newest":  # protected ones too: they serve evaluation (@best, @healthy), not rollback
        for old in list_checkpoints(run_dir):
            if old != step:
                drop_optimizer_state(root / f"step-{old}")
    return final


def _for_disk(state: dict[str, torch.Tensor], dtype: str, what: str) -> dict[str, torch.Tensor]:
    """``state`` in ``dtype``, after :func:`_check_range`."""
    _check_range(state, dtype, what)
    return in_dtype(state, dtype)


def _check_range(state: dict[str, torch.Tensor], dtype: str, what: str) -> None:
    """A weight beyond float16's range is refused before anything is written, never stored as inf."""
    if dtype != "float16":
        return
    limit = torch.finfo(torch.float16).max
    for name, tensor in state.items():
        largest = float(tensor.detach().abs().max()) if tensor.is_floating_point() and tensor.numel() else 0.0
        if largest > limit:
            raise ValueError(f"checkpoint.dtype=float16 cannot hold the {what}'s {name} (|w| up to {largest:.3g}, "
                             f"float16 ends at {limit:.0f}): it would be written as inf. Rerun with --resume --set "
                             "checkpoint.dtype=bfloat16 (float32's range)")


def _record_dtype(folder: Path, dtype: str) -> None:
    """The model folders' config.json name the dtype the weights are stored in (transformers wrote the modules'),
    so loaders with dtype "auto" (transformers, vLLM) load them at that size."""
    for model in MODEL_FOLDERS:
        path = folder / model / "config.json"
        if not path.exists():
            continue
        config = json.loads(path.read_text())
        keys = [key for key in ("dtype", "torch_dtype") if key in config] or ["dtype"]
        config.update({key: dtype for key in keys})
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def check_checkpoint_settings(dtype: str | None, optimizer_policy: str, on_collapse: str | None = None) -> None:
    """``checkpoint.dtype`` and ``checkpoint.optimizer`` as :func:`save_checkpoint` reads them (ValueError, one
    line, with the closest valid value)."""
    if dtype is not None and dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"checkpoint.dtype must be {', '.join(CHECKPOINT_DTYPES)} or null, got {dtype!r}"
                         f"{did_you_mean(str(dtype), CHECKPOINT_DTYPES)}")
    if optimizer_policy not in CHECKPOINT_OPTIMIZER:
        choices = f"{', '.join(CHECKPOINT_OPTIMIZER[:-1])} or {CHECKPOINT_OPTIMIZER[-1]}"
        raise ValueError(f"checkpoint.optimizer must be {choices}, got {optimizer_policy!r}"
                         f"{did_you_mean(str(optimizer_policy), CHECKPOINT_OPTIMIZER)}")
    if optimizer_policy != "all" and on_collapse == "rollback":
        dropped = "drops" if optimizer_policy == "newest" else "never writes"
        raise ValueError(f"checkpoint.optimizer={optimizer_policy} {dropped} the optimizer state that "
                         "monitor.on_collapse=rollback restores from an older checkpoint: use "
                         "checkpoint.optimizer=all with rollback")


def in_dtype(state: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """Floating-point tensors of ``state`` in ``dtype``; tensors that shared storage (tied embeddings) still do,
    so save_pretrained writes them once."""
    target, converted = getattr(torch, dtype), {}
    out = {}
    for key, tensor in state.items():
        if not tensor.is_floating_point():
            out[key] = tensor
            continue
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if storage not in converted:
            converted[storage] = tensor.detach().to(target)
        out[key] = converted[storage]
    return out


def drop_optimizer_state(folder: Path) -> None:
    """Remove an older checkpoint's resume-only state (the optimizer state, the lagged policy): their manifest
    entries first (atomically), then the files. A kill between the two leaves unlisted files, which verification
    tolerates and loading ignores (a later drop removes them)."""
    manifest_path = folder / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return  # not ours to repair: verify_checkpoint reports it
    if not isinstance(manifest, dict):
        return
    dropped = [name for name in RESUME_FILES if manifest.pop(name, None) is not None]
    if dropped:
        scratch = folder.parent / f".{folder.name}.manifest.tmp"
        scratch.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(scratch, manifest_path)
    for name in RESUME_FILES:
        (folder / name).unlink(missing_ok=True)


def holds_resume_state(folder: Path) -> bool:
    """Whether a checkpoint's manifest lists its optimizer state (it can be resumed or rolled back to)."""
    try:
        return OPTIMIZER_FILE in json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0's CPU (gathered from FSDP2 shards; empty on other ranks).
    A collective under FSDP2: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a whole (unsharded) state dict into ``model``, plain or sharded by FSDP2 (each rank keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Optimizer state keyed by parameter name, with full (unsharded) tensors on rank 0's CPU: loadable under
    DDP or FSDP2 with any number of processes. A collective under FSDP2: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load :func:`full_optimizer_state`'s output (every rank passes the whole state; FSDP2 keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def list_checkpoints(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir())


def valid_checkpoints(run_dir: Path) -> list[int]:
    """Steps of the checkpoints that verify, oldest first (corrupt ones are left out silently)."""
    valid = []
    for step in list_checkpoints(run_dir):
        try:
            verify_checkpoint(run_dir / "checkpoints" / f"step-{step}")
            valid.append(step)
        except CorruptCheckpointError:
            continue
    return valid


def set_aside(folder: Path, prefix: str) -> Path:
    """Rename ``checkpoints/step-N`` to ``checkpoints/.{prefix}-step-N`` (replacing an older one): kept for
    inspection, invisible to resume and pruning."""
    aside = folder.with_name(f".{prefix}-{folder.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(folder, aside)
    return aside


class NoOptimizerStateError(CorruptCheckpointError):
    """A checkpoint without optimizer state (``checkpoint.optimizer=newest`` kept it in a newer one only, ``none`` in
    none)."""


def why_no_optimizer_state(folder: Path) -> str:
    """Which checkpoint.optimizer setting left ``folder`` without optimizer state, as its run recorded it."""
    try:
        config = migrate_flat(json.loads((folder / "trainer_state.json").read_text()).get("config", {}))[0]
        policy = (config.get("checkpoint") or {}).get("optimizer")
    except (OSError, ValueError, AttributeError):
        policy = None
    if policy == "none":
        return "its run wrote none: checkpoint.optimizer=none"
    return "checkpoint.optimizer=newest keeps it in the newest checkpoint only"


def load_trainer_state(folder: Path, optimizer: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's tensor state (optimizer state included: ``optimizer=False`` reads a checkpoint that dropped
    it) and its JSON state, after verifying it."""
    verify_checkpoint(folder)
    tensors = torch.load(folder / "trainer_state.pt", map_location="cpu", weights_only=True)
    listed = json.loads((folder / "manifest.json").read_text())
    if OPTIMIZER_FILE in listed:  # an unlisted one is the leftover of an interrupted drop: unverified, never read
        tensors.update(torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
    if LAGGED_FILE in listed:
        tensors["stale_policy"] = load_lagged(folder / LAGGED_FILE)
    if optimizer and "actor_optimizer" not in tensors:
        raise NoOptimizerStateError(
            f"{folder} holds no optimizer state ({why_no_optimizer_state(folder)}), so it cannot be resumed or rolled "
            f"back to; its weights start a new run: --model {folder / 'actor'}")
    return tensors, json.loads((folder / "trainer_state.json").read_text())
