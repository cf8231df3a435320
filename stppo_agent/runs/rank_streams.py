"""Every data-parallel rank's random streams in checkpoints, so that a resumed multi-process run continues exactly.

Each rank samples from its own streams (:func:`stppo_agent.distributed.process_group.rank_seed`). A checkpoint's main
RNG entries (``torch_rng``, ``cuda_rng``, ``python_rng``, ``numpy_rng``) are rank 0's, as in a one-process run; with
several processes ``rank_rng`` adds every rank's, in rank order (the tensors in ``trainer_state.pt``, Python's
and NumPy's states in ``trainer_state.json``). On resume rank r > 0 takes entry r; when the checkpoint has none
for it (written by fewer processes, or before checkpoints held them) it starts a fresh stream seeded from
(seed, rank, iteration) and says so: a resume with another number of processes cannot continue streams that
never existed.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import torch

from stppo_agent.distributed import process_group


def save(tensors: dict[str, Any], json_state: dict[str, Any]) -> None:
    """Add every rank's streams to a checkpoint's states (a collective with several processes; nothing with one)."""
    if process_group.world_size() == 1:
        return
    local = {"torch": torch.get_rng_state(), "python": jsonable(random.getstate()),
             "numpy": jsonable(np.random.get_state())}
    if torch.cuda.is_available():
        local["cuda"] = torch.cuda.get_rng_state_all()
    everyone = process_group.all_gather_objects(local)
    tensors["rank_rng"] = [{key: state[key] for key in ("torch", "cuda") if key in state} for state in everyone]
    json_state["rank_rng"] = [{"python": state["python"], "numpy": state["numpy"]} for state in everyone]


def restore(tensors: dict[str, Any], json_state: dict[str, Any], *, seed: int, iteration: int,
            report: Callable[[str], None]) -> None:
    """Put back this rank's streams (rank 0's are the checkpoint's main entries, restored by the caller); a rank
    the checkpoint holds none for starts a fresh stream from (``seed``, its rank, ``iteration``)."""
    rank = process_group.rank()
    if rank == 0:
        return
    saved, saved_json = tensors.get("rank_rng") or [], json_state.get("rank_rng") or []
    if rank < len(saved) and rank < len(saved_json):
        torch.set_rng_state(saved[rank]["torch"])
        if "cuda" in saved[rank] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved[rank]["cuda"])
        random.setstate(python_state(saved_json[rank]["python"]))
        np.random.set_state(numpy_state(saved_json[rank]["numpy"]))
        return
    fresh = int(np.random.SeedSequence([seed % 2**64, rank, iteration]).generate_state(1)[0])
    process_group.seed_everything(fresh)
    report(f"rank {rank}: the checkpoint holds no random state for this rank (written by "
                   f"{max(1, len(saved))} process(es)); its sampling continues from a fresh stream (seed {fresh})")


def jsonable(value):
    """A Python / NumPy random state as JSON (arrays as lists with their dtype); undone by the two below."""
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, tuple):
        return [jsonable(v) for v in value]
    return value


def python_state(state):
    return (state[0], tuple(state[1]), state[2])


def numpy_state(state):
    array = state[1]
    return (state[0], np.array(array["ndarray"], dtype=array["dtype"]), *state[2:])
