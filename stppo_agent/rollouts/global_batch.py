"""Global mini-batches under data parallelism: the same optimizer steps as one process on the global batch.

Each rank plays and scores its own share of an iteration's episodes. Shuffling each share on its own would make
the global mini-batches other unions of rows than one process's (and the run differ from single-process
training as soon as an epoch has more than one mini-batch). Instead every rank gathers the scored global batch
(:func:`gather_global_batch`: one collective per iteration, rows in single-process order), all ranks draw the
same permutation, and each takes every world-th row of each global mini-batch (:func:`mini_batch_rows`): equal
shares, so DDP's and FSDP2's collectives line up, and gradients normalised by global counts add up to exactly
the global mini-batch's gradient. The cost is holding the global batch's tensors (not the models' activations)
on every rank.
"""

from __future__ import annotations

import dataclasses

import torch

from stppo_agent.distributed import process_group
from stppo_agent.rollouts.batch import RolloutBatch

# Padding of the per-token (B, T) fields beyond a share's width; every other tensor pads with 0 / False.
RESPONSE_FILL = {"turn_ids": -1}


def gather_global_batch(batch: RolloutBatch, pad_id: int) -> RolloutBatch:
    """Every rank's share of the batch, concatenated, on every rank, in single-process row order: sorted by
    ``group_ids`` (each prompt's samples stay together and in order on one rank; shares are prompts
    ``rank::world``), stably, so a source without meaningful groups keeps rank order. Prompts are left-padded
    and responses right-padded to the widest share. ``stats`` stay this rank's (combined by
    :mod:`stppo_agent.rollouts.statistics`)."""
    device = batch.response_ids.device
    return merge_shares(process_group.all_gather_objects(batch.to("cpu")), pad_id, dict(batch.stats)).to(device)


def merge_shares(shares: list[RolloutBatch], pad_id: int, stats: dict) -> RolloutBatch:
    """``shares`` concatenated into one batch with ``stats``, rows in single-process order (by ``group_ids``,
    stably), prompts left-padded and responses right-padded to the widest share (also replay's merge of the
    shares an iteration was recorded in)."""
    prompt_width = max(share.prompt_width for share in shares)
    response_width = max(share.response_ids.shape[1] for share in shares)
    fields = {}
    for field in dataclasses.fields(RolloutBatch):
        name, values = field.name, [getattr(share, field.name) for share in shares]
        if name == "prompt_width":
            fields[name] = prompt_width
        elif name == "stats":
            fields[name] = stats
        elif all(value is None for value in values):
            fields[name] = None
        elif any(value is None for value in values):
            raise ValueError(f"{name} is set on some ranks' batches and not on others")
        elif isinstance(values[0], list):
            fields[name] = [item for value in values for item in value]
        elif name in ("input_ids", "attention_mask"):
            fill = pad_id if name == "input_ids" else 0
            fields[name] = torch.cat([_pad_sequence(value, share.prompt_width, prompt_width, response_width, fill)
                                      for value, share in zip(values, shares)])
        elif values[0].dim() == 2:
            fill = RESPONSE_FILL.get(name, pad_id if name == "response_ids" else 0)
            fields[name] = torch.cat([_pad_right(value, response_width, fill) for value in values])
        else:
            fields[name] = torch.cat(values)
    merged = RolloutBatch(**fields)
    return merged.select(torch.sort(merged.group_ids, stable=True).indices)


def _pad_right(value: torch.Tensor, width: int, fill) -> torch.Tensor:
    if value.shape[1] == width:
        return value
    pad = torch.full((value.shape[0], width - value.shape[1]), fill, dtype=value.dtype)
    return torch.cat([value, pad], dim=1)


def _pad_sequence(value: torch.Tensor, own_prompt: int, prompt_width: int, response_width: int, fill) -> torch.Tensor:
    """Left-pad the prompt part to ``prompt_width``, right-pad the response part to ``response_width``."""
    prompt, response = value[:, :own_prompt], value[:, own_prompt:]
    left = torch.full((value.shape[0], prompt_width - own_prompt), fill, dtype=value.dtype)
    return torch.cat([left, prompt, _pad_right(response, response_width, fill)], dim=1)


def mini_batch_rows(order: torch.Tensor, start: int, mini_batch_size: int, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of the global mini-batch ``order[start:start + mini_batch_size]``: every world-th one.
    Batch and mini-batch sizes are multiples of ``world`` (checked by the trainer), so every rank gets as many."""
    return order[start:start + mini_batch_size][rank::world]
