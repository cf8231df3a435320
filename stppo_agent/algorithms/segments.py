"""Segment reductions over (trajectory, turn) without Python loops, and masked batch statistics."""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` (bool, same shape) is True. Masked entries never enter, even as NaN."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over True entries of ``mask`` (0 when there are none)."""
    return masked_sum(x, mask) / mask.sum().clamp(min=1).to(x.dtype)


def turn_segment_ids(turn_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Flat turn id per position, (b, k) -> b * T + k, and an upper bound on the number of turns (B * T).

    Turn ids are < T, so no host sync is needed to size the buckets. Positions outside ``loss_mask`` get id 0 and
    must be masked by the caller. turn_ids (B, T) long, loss_mask (B, T) bool -> ids (B, T) long.
    (Token and sequence levels need no ids: the ratio is per position, or a masked sum per row.)
    """
    batch, length = loss_mask.shape
    rows = torch.arange(batch, device=loss_mask.device).unsqueeze(1)
    ids = rows * length + turn_ids.clamp(min=0, max=length - 1)
    return torch.where(loss_mask, ids, torch.zeros_like(ids)), batch * length


def check_turn_ids(turn_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
    """Policy tokens need a turn id in [0, T); a cheap check callers run once per batch (it syncs)."""
    length = loss_mask.shape[1]
    bad = loss_mask & ((turn_ids < 0) | (turn_ids >= length))
    if bad.any():
        raise ValueError("turn_ids must be in [0, T) on every policy token (loss_mask True)")


def segment_sum(x: torch.Tensor, ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sum of ``x`` over each segment -> (num_segments,). ``x`` must already be 0 off the mask.

    Differentiable (index_add; its backward is a gather).
    """
    return torch.zeros(num_segments, dtype=x.dtype, device=x.device).index_add(0, ids.reshape(-1), x.reshape(-1))


def broadcast_segments(per_segment: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-segment values back to positions. ``index_select`` (not ``x[ids]``): its backward is an index_add,
    several times faster on CPU than the index_put that advanced indexing uses."""
    return per_segment.index_select(0, ids.reshape(-1)).view(ids.shape)


def segment_counts(ids: torch.Tensor, num_segments: int, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Number of masked positions in each segment -> (num_segments,)."""
    return torch.zeros(num_segments, dtype=dtype, device=mask.device).index_add(
        0, ids.reshape(-1), mask.reshape(-1).to(dtype))


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased variance); masked-out entries become 0."""
    mean = masked_mean(x, mask)
    count = mask.sum()
    centered = torch.where(mask, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    var = (centered**2).sum() / (count - 1).clamp(min=1).to(x.dtype)
    return centered * torch.rsqrt(var + eps)


def discounted_reverse_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """y_j = sum_{k >= 0} discount^k x_{j+k} along the last dim, by a doubling scan (log2 T vector steps).

    After the step with stride s, y_j holds sum_{k < 2s} discount^k x_{j+k}; no loop over positions.
    """
    if discount == 1.0:
        return x.flip(-1).cumsum(-1).flip(-1)
    y = x.clone()
    length = x.shape[-1]
    stride, weight = 1, discount
    while stride < length and weight != 0.0:
        shifted = torch.zeros_like(y)
        shifted[..., : length - stride] = y[..., stride:]
        y = y + weight * shifted
        stride, weight = stride * 2, weight * weight
    return y


def quantile(values: torch.Tensor, q: float) -> float:
    """``torch.quantile`` of any size: it refuses inputs over 16M elements, so beyond that the sorted values are
    subsampled evenly (the tails stay)."""
    if values.numel() > 1 << 24:
        values = values.sort().values[torch.linspace(0, values.numel() - 1, 1 << 24).long()]
    return float(torch.quantile(values.double(), q))
