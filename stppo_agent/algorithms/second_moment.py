"""M2PO's mask (docs/algorithms.md, "M2PO"): drop the segments with the largest squared log-ratio until the
second moment of the rest is below the threshold, the statistic taken over every data-parallel rank's batch.

A segment is a policy token (ratio level ``token``), a (trajectory, turn) pair (``turn``) or a trajectory
(``sequence``); its squared log-ratio is that of its level ratio, and it weighs as many tokens as it has, so the
second moment is always per policy token. Segments are sorted by squared log-ratio, largest first (a stable sort
of the rank-ordered concatenation: every rank finds the same cut, ties broken the same way); the k largest are
dropped, k the smallest number that leaves a mean below the threshold -- all but the smallest one when no k
does (AReaL keeps one token too).
"""

from __future__ import annotations

import torch

from stppo_agent.distributed.process_group import all_reduce_sum, rank, world_size

from .segments import segment_counts, segment_sum, turn_segment_ids


def segment_ids(loss_mask: torch.Tensor, turn_ids: torch.Tensor, level: str) -> tuple[torch.Tensor, int]:
    """Per position, the id of its segment at ``level`` (0 off the mask), and the number of ids."""
    batch, length = loss_mask.shape
    if level == "token":
        ids = torch.arange(batch * length, device=loss_mask.device).view(batch, length)
        return torch.where(loss_mask, ids, torch.zeros_like(ids)), batch * length
    if level == "turn":
        return turn_segment_ids(turn_ids, loss_mask)
    if level == "sequence":
        ids = torch.arange(batch, device=loss_mask.device).unsqueeze(1).expand(batch, length)
        return torch.where(loss_mask, ids, torch.zeros_like(ids)), batch
    raise ValueError(f"unknown ratio level {level!r}; known: token, turn, sequence")


def keep_items(values: torch.Tensor, weights: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which items survive: drop the largest ``values`` until the ``weights``-weighted mean of the rest is below
    ``threshold`` (all but the smallest when no cut gets there)."""
    count = values.numel()
    if count == 0:
        return torch.ones(0, dtype=torch.bool, device=values.device)
    sorted_values, order = torch.sort(values, descending=True, stable=True)
    sorted_weights = weights[order]
    tail_sums = (sorted_values * sorted_weights).flip(0).cumsum(0).flip(0)
    tail_weights = sorted_weights.flip(0).cumsum(0).flip(0)
    below = torch.nonzero(tail_sums / tail_weights.clamp(min=1e-30) < threshold).flatten()
    dropped = int(below[0]) if below.numel() else count - 1
    keep_sorted = torch.arange(count, device=values.device) >= dropped
    return torch.empty_like(keep_sorted).scatter(0, order, keep_sorted)


def _concatenate_over_ranks(columns: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every rank's rows of ``columns`` (n_r, k) in rank order, and where this rank's start. Sums of zero-padded
    buffers (all_reduce_sum is the one collective the algorithms use): exact, each entry has one writer."""
    world = world_size()
    if world == 1:
        return columns, 0
    sizes = torch.zeros(world, dtype=torch.float64, device=columns.device)
    sizes[rank()] = columns.shape[0]
    sizes = all_reduce_sum(sizes).long().tolist()
    offset = sum(sizes[:rank()])
    buffer = torch.zeros(sum(sizes), columns.shape[1], dtype=columns.dtype, device=columns.device)
    buffer[offset:offset + columns.shape[0]] = columns
    return all_reduce_sum(buffer), offset


@torch.no_grad()
def m2po_keep_mask(log_ratio: torch.Tensor, loss_mask: torch.Tensor, turn_ids: torch.Tensor, level: str,
                   threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep (B, T) bool, False off the mask; the second moment per policy token over all ranks before the cut).

    ``log_ratio`` is the level log-ratio per position (the same value on every token of a segment). A collective
    when distributed: every rank must call it (the trainer's ranks see equally many micro-batches)."""
    ids, num_segments = segment_ids(loss_mask, turn_ids, level)
    counts = segment_counts(ids, num_segments, loss_mask, torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=log_ratio.device)
    squares = segment_sum(torch.where(loss_mask, log_ratio.double() ** 2, zero), ids, num_segments)
    present = counts > 0
    local = torch.stack([squares[present] / counts[present], counts[present]], dim=1)
    everything, offset = _concatenate_over_ranks(local)
    keep = keep_items(everything[:, 0], everything[:, 1], threshold)[offset:offset + local.shape[0]]
    keep_segments = torch.zeros(num_segments, dtype=torch.bool, device=log_ratio.device)
    keep_segments[present] = keep
    second_moment = (everything[:, 0] * everything[:, 1]).sum() / everything[:, 1].sum().clamp(min=1)
    return loss_mask & keep_segments.index_select(0, ids.reshape(-1)).view_as(loss_mask), second_moment


@torch.no_grad()
def m2po_keep_masks(log_ratios: list[torch.Tensor], loss_masks: list[torch.Tensor], turn_ids: list[torch.Tensor],
                    level: str, threshold: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`m2po_keep_mask` over several micro-batches of different lengths at once (the whole optimizer batch
    of this rank, every rank's taken together as there): one keep mask per micro-batch, and the second moment."""
    length = max(mask.shape[1] for mask in loss_masks)

    def padded(tensors: list[torch.Tensor], value) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value) for t in tensors])

    keep, second_moment = m2po_keep_mask(padded(log_ratios, 0.0), padded(loss_masks, False),
                                         padded(turn_ids, -1), level, threshold)
    masks, start = [], 0
    for mask in loss_masks:
        rows, width = mask.shape
        masks.append(keep[start:start + rows, :width])
        start += rows
    return masks, second_moment
