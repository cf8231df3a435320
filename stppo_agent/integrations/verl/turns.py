"""The turn record: where each assistant turn of a response lies, written by the bridge's agent loops when they play
an episode and read back by the policy losses and the reward function, which see only what verl hands them.

verl's response mask is not a record of the turns. At rollout its runs of 1s are the assistant turns, but verl's
trainer edits it afterwards: token-level rollout rejection (``algorithm.rollout_correction.rollout_rs=token_*``)
zeroes single tokens inside a turn, and a run of the mask then splits one turn in two. The reward function sees
only the decoded text, where an ``<information>`` block the policy wrote reads like one the env inserted. So the
agent loops (``stppo_env``, ``stppo_tool_agent``) put the turns in the output's ``extra_fields``, which verl carries
per row into the batch (and into ``extra_info`` of the reward function):

- ``stppo_turn_spans``: ``[[start, end], ...]``, response-token positions of each assistant turn, for the losses
  (the ``stppo`` engine hands them over per micro-batch: :func:`recorded`);
- ``stppo_turn_texts``: each turn's text as the policy wrote it, for :mod:`.reward`.

Works without verl.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Sequence

import torch
import torch.nn.functional as F

TURN_SPANS = "stppo_turn_spans"
TURN_TEXTS = "stppo_turn_texts"

logger = logging.getLogger(__name__)
_state = threading.local()
_warned: set[str] = set()  # losses already warned, once per process


def spans_from_mask(mask: Sequence[int]) -> list[list[int]]:
    """``[start, end)`` of each maximal run of 1s: the assistant turns of a mask as an agent loop builds it (before
    verl edits it).

    >>> spans_from_mask([1, 1, 0, 0, 1, 0, 1])
    [[0, 2], [4, 5], [6, 7]]
    """
    spans, start = [], None
    for position, value in enumerate(list(mask) + [0]):
        if value and start is None:
            start = position
        elif not value and start is not None:
            spans.append([start, position])
            start = None
    return spans


def turn_ids_from_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """Turn id of every response token read from the mask alone: the k-th maximal run of 1s is turn k; -1 where the
    mask is 0. Right only while the mask is the one the agent loop built.

    >>> turn_ids_from_mask(torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1], [1, 1, 1, 1, 0, 0, 0, 0]])).tolist()
    [[-1, 0, 0, -1, -1, 1, -1, 2], [0, 0, 0, 0, -1, -1, -1, -1]]
    """
    mask = response_mask.bool()
    starts = mask & ~F.pad(mask[:, :-1], (1, 0), value=False)
    ids = starts.long().cumsum(1) - 1
    return torch.where(mask, ids, torch.full_like(ids, -1))


def turn_ids_from_spans(spans_per_row: Sequence, response_mask: torch.Tensor) -> torch.Tensor:
    """Turn ids from the record: turn k covers its span whatever the mask says inside it; -1 where the mask is 0. A
    row recorded as None (from an agent loop that writes no record) is read from its mask. A token of the mask
    outside every span of its row means the record is not this batch's: refused."""
    mask = response_mask.bool()
    if len(spans_per_row) != mask.shape[0]:
        raise ValueError(f"turn record: {len(spans_per_row)} rows for a batch of {mask.shape[0]}")
    ids = turn_ids_from_mask(mask)
    for row, spans in enumerate(spans_per_row):
        if spans is None:
            continue
        ids[row] = -1
        for turn, (start, end) in enumerate(spans):
            ids[row, int(start):int(end)] = turn
    uncovered = mask & (ids < 0)
    if bool(uncovered.any()):
        row = int(uncovered.any(1).nonzero()[0])
        raise ValueError(f"turn record: row {row} has policy tokens outside its recorded turns "
                         f"{list(spans_per_row[row])}; the record does not belong to this batch")
    return torch.where(mask, ids, torch.full_like(ids, -1))


@contextmanager
def recorded(spans_per_row: Sequence | None):
    """While active on this thread, :func:`turn_ids` reads turns from ``spans_per_row`` (the micro-batch's record;
    None: the micro-batch has none)."""
    previous = getattr(_state, "spans", None)
    _state.spans = spans_per_row
    try:
        yield
    finally:
        _state.spans = previous


def turn_ids(response_mask: torch.Tensor, loss_name: str, warn: bool = True) -> torch.Tensor:
    """The turn ids a loss uses: from the record handed over by the engine, else (for the whole micro-batch, or a
    row without a record) from the mask's runs; ``warn``: say so once per process and loss, since a token rejected
    inside a turn then splits it."""
    spans = getattr(_state, "spans", None)
    if warn and (spans is None or any(row is None for row in spans)) and loss_name not in _warned:
        _warned.add(loss_name)
        logger.warning("%s: no turn record reached the loss for some rows, so their turns are read from runs of the "
                       "response mask, and a token that verl's rollout_rs=token_* rejects inside a turn splits it in "
                       "two; the stppo engine (VERL_ENGINE_VENDOR=stppo) hands the record of the stppo_env and "
                       "stppo_tool_agent loops over (docs/verl.md)", loss_name)
    return turn_ids_from_mask(response_mask) if spans is None else turn_ids_from_spans(spans, response_mask)
