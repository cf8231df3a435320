"""Clipping-bias correction of S-PPO / ST-PPO (ALGORITHMS.md, "Clipping-bias correction").

C(theta) = grad agg(c_t * rho_t * A_t) is the part of the importance-weighted gradient that clipping removed.
The corrected policy gradient is  g = grad L_clip / max(1, ||C||_2 / kappa).

Use per optimizer step::

    corrector = ClipBiasCorrector(actor.parameters(), kappa=config.clip_bias_kappa)
    for micro_batch in micro_batches:
        loss, bias_surrogate, metrics = policy_loss(...)
        corrector.accumulate(bias_surrogate)      # one extra backward into a side buffer (retains the graph)
        loss.backward()
    # (data parallel: DDP has averaged .grad; corrector.all_reduce() averages C the same way)
    metrics = corrector.apply()                   # scales .grad of the actor; before grad-norm clipping
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


class ClipBiasCorrector:
    """Accumulates C over micro-batches and rescales the actor's gradient by max(1, ||C|| / kappa)."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter], kappa: float = 1.0):
        self.parameters = [p for p in parameters if p.requires_grad]
        if kappa <= 0:
            raise ValueError(f"kappa must be > 0, got {kappa}")
        self.kappa = kappa
        self._bias: list[torch.Tensor] | None = None

    def accumulate(self, bias_surrogate: torch.Tensor) -> None:
        """Add grad(bias_surrogate) to C without touching ``.grad`` (the loss backward comes after)."""
        if not bias_surrogate.requires_grad:  # nothing in this micro-batch depends on the policy
            return
        grads = torch.autograd.grad(bias_surrogate, self.parameters, retain_graph=True, allow_unused=True)
        if self._bias is None:
            self._bias = [torch.zeros_like(p) for p in self.parameters]
        for total, grad in zip(self._bias, grads):
            if grad is not None:
                total.add_(grad)

    def all_reduce(self, group=None) -> None:
        """Average C over data-parallel ranks exactly as DDP averages gradients (no-op when not distributed)."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        world = dist.get_world_size(group)
        if self._bias is None:
            self._bias = [torch.zeros_like(p) for p in self.parameters]
        flat = torch.cat([t.reshape(-1) for t in self._bias])  # one collective instead of one per tensor
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(world)
        offset = 0
        for total in self._bias:
            total.copy_(flat[offset:offset + total.numel()].view_as(total))
            offset += total.numel()

    def apply(self) -> dict[str, torch.Tensor]:
        """Scale the actor's gradients; return ``clip_bias_norm``, ``pg_grad_norm``, ``clip_bias_scale``; reset C."""
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        bias_norm = _global_norm(self._bias or [], device)
        grads = [p.grad for p in self.parameters if p.grad is not None]
        grad_norm = _global_norm(grads, device)
        scale = torch.clamp(bias_norm / self.kappa, min=1.0)
        for grad in grads:
            grad.div_(scale.to(grad.dtype))
        self._bias = None
        return {"clip_bias_norm": bias_norm, "pg_grad_norm": grad_norm, "clip_bias_scale": scale}


def _global_norm(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), device=device)
    # Half-precision tensors are normed in float32; float64 stays float64 (exactness in tests and reductions).
    norms = [torch.linalg.vector_norm(t if t.dtype in (torch.float32, torch.float64) else t.float()) for t in tensors]
    dtype = torch.float64 if any(n.dtype == torch.float64 for n in norms) else torch.float32
    return torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in norms]))
