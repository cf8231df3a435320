"""Float64 helpers and policy batches of the device and dtype tests (a GPU user's batch is
on the GPU: torch's default device and the meta device stand in for it here)."""

from __future__ import annotations

import torch

F64 = torch.float64


# -- policy losses, the KL reward penalty and the segment reductions under them ---------------------------------


def _policy_batch():
    generator = torch.Generator().manual_seed(3)
    loss_mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    turn_ids = torch.where(loss_mask, torch.tensor([[0, 0, 0, 1, 1]]).expand(3, 5), -1)
    old = -torch.rand(3, 5, generator=generator, dtype=F64) - 0.5
    logprobs = (old + 0.6 * torch.randn(3, 5, generator=generator, dtype=F64)).requires_grad_()
    advantages = torch.randn(3, 5, generator=generator, dtype=F64)
    ref = old - 0.1 * torch.rand(3, 5, generator=generator, dtype=F64)
    return dict(logprobs=logprobs, old_logprobs=old, advantages=advantages, loss_mask=loss_mask, turn_ids=turn_ids,
                ref_logprobs=ref)
