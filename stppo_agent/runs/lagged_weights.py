"""The lagged policy of a ``rollout.staleness: K`` run in a checkpoint: ``lagged_policy.safetensors``.

What a resume needs to continue the lag exactly (:class:`stppo_agent.training.stale_policy.StalePolicy`): the
generating weights (after ``S - K`` updates at step S) and the queue of later weights, less the newest queued one,
which is the checkpoint's own actor and is taken from ``actor/`` on load. So K copies of the actor, not K + 1:

- in ``checkpoint.dtype`` when it is set (2 bytes a parameter in bfloat16; a resume continues from the rounded
  copies, as it does from the rounded actor), else in the weights' own dtype (a float32 resume is bit-identical);
- tensors a model ties (an output head sharing the embedding matrix) stored once;
- like the optimizer state, only in the newest checkpoint under ``checkpoint.optimizer=newest`` (an older one
  cannot be resumed anyway).

Safetensors, so nothing is unpickled. Keys: ``generator.NAME`` and ``pending.I.NAME``; the metadata says how many
queued entries the file holds, whether the actor completes the queue, and which names alias which.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

LAGGED_FILE = "lagged_policy.safetensors"


def save_lagged(path: Path, state: dict[str, Any], dtype: str | None) -> None:
    """Write :meth:`StalePolicy.state` to ``path`` (floating-point tensors in ``dtype`` when given)."""
    from safetensors.torch import save_file

    aliases: dict[str, str] = state.get("aliases", {})
    target = getattr(torch, dtype) if dtype else None
    tensors = {}
    for prefix, weights in [("generator", state["model"]),
                            *((f"pending.{i}", entry) for i, entry in enumerate(state["pending"]))]:
        for name, value in weights.items():
            if name in aliases:
                continue
            value = value.detach()
            if target is not None and value.is_floating_point():
                value = value.to(target)
            tensors[f"{prefix}.{name}"] = value.contiguous()
    metadata = {"pending": str(len(state["pending"])), "pending_from_actor": str(int(state["pending_from_actor"])),
                "aliases": json.dumps(aliases, sort_keys=True)}
    save_file(tensors, str(path), metadata=metadata)


def load_lagged(path: Path) -> dict[str, Any]:
    """What :func:`save_lagged` wrote, as :meth:`StalePolicy.load` takes it."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    aliases = json.loads(metadata.get("aliases", "{}"))
    count = int(metadata.get("pending", "0"))

    def entry(prefix: str) -> dict[str, torch.Tensor]:
        weights = {key[len(prefix) + 1:]: value for key, value in tensors.items() if key.startswith(prefix + ".")}
        weights.update({name: weights[source] for name, source in aliases.items() if source in weights})
        return weights

    return {"model": entry("generator"), "pending": [entry(f"pending.{i}") for i in range(count)],
            "pending_from_actor": metadata.get("pending_from_actor") == "1", "aliases": aliases}
