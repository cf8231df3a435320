"""Clipping-bias correction of S-PPO / ST-PPO (docs/algorithms.md, "Clipping-bias correction").

C(theta) = grad agg(c_t * rho_t * A_t) is the part of the importance-weighted gradient that clipping removed.
The corrected policy gradient is  g = grad L_clip / max(1, ||C||_2 / kappa).

Use per optimizer step::

    corrector = ClipBiasCorrector(actor.parameters(), kappa=config.clip_bias_kappa)
    for micro_batch in micro_batches:
        loss, bias_surrogate, metrics = policy_loss(...)
        corrector.accumulate(bias_surrogate)      # one extra backward into a side buffer (retains the graph)
        loss.backward()
    # (data parallel: DDP has averaged .grad; corrector.all_reduce() averages C the same way)
    metrics = corrector.apply()                   # scales .grad of the actor (before grad-norm clipping;
                                                  # measure() / scale_gradients() split it around the clipping)

With FSDP2-sharded parameters (``through_grad=True``) ``torch.autograd.grad`` cannot reach the parameters
(forward runs on gathered copies), so C comes from a second ``backward`` into ``.grad``, which FSDP2
reduce-scatters and averages like any gradient: ``accumulate`` parks the loss gradient accumulated so far, takes
C's share from ``.grad`` and puts the loss gradient back. ``all_reduce`` is then a no-op and norms sum the
squared shards over ranks.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from stppo_agent.distributed.process_group import all_reduce_sum, global_norm, local_tensor


class ClipBiasCorrector:
    """Accumulates C over micro-batches and rescales the actor's gradient by max(1, ||C|| / kappa)."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter], kappa: float = 1.0, through_grad: bool = False,
                 rescale: bool = True):
        self.parameters = [p for p in parameters if p.requires_grad]
        if kappa <= 0:
            raise ValueError(f"kappa must be > 0, got {kappa}")
        self.kappa = kappa
        self.through_grad = through_grad
        self.rescale = rescale  # False: only measure ||C|| (diagnostics of algorithms without the correction)
        self._bias: list[torch.Tensor] | None = None

    def accumulate(self, bias_surrogate: torch.Tensor, anchor: torch.Tensor | None = None) -> None:
        """Add grad(bias_surrogate) to C; ``.grad`` is left as it was (the loss backward comes after).

        With ``through_grad`` every rank calls this for every micro-batch: a backward through sharded parameters
        is a collective, so all ranks take it or none does. A rank with nothing clipped (surrogate without grad)
        then back-propagates zero through ``anchor``, any tensor of this micro-batch's graph (its log-probs)."""
        if self.through_grad:
            clipped_ranks = all_reduce_sum(torch.tensor(float(bias_surrogate.requires_grad),
                                                        device=bias_surrogate.device))
            if clipped_ranks > 0:
                if not bias_surrogate.requires_grad:
                    if anchor is None:
                        raise ValueError("through_grad needs an anchor tensor for ranks with nothing clipped")
                    bias_surrogate = anchor.sum() * 0.0
                self._accumulate_through_grad(bias_surrogate)
            return
        if not bias_surrogate.requires_grad:  # nothing in this micro-batch depends on the policy
            return
        grads = torch.autograd.grad(bias_surrogate, self.parameters, retain_graph=True, allow_unused=True)
        if self._bias is None:
            self._bias = [torch.zeros_like(p) for p in self.parameters]
        for total, grad in zip(self._bias, grads):
            if grad is not None:
                total.add_(grad)

    def _accumulate_through_grad(self, bias_surrogate: torch.Tensor) -> None:
        # FSDP2 may hand out gradients that are views of its communication buffers, which the next
        # reduce-scatter overwrites: both the parked loss gradient and C's share are copied.
        parked = [None if p.grad is None else p.grad.clone() for p in self.parameters]
        for param in self.parameters:
            param.grad = None
        bias_surrogate.backward(retain_graph=True)
        if self._bias is None:
            self._bias = [torch.zeros_like(p) for p in self.parameters]
        for total, param, grad in zip(self._bias, self.parameters, parked):
            if param.grad is not None:
                total.add_(param.grad)
            param.grad = grad

    def all_reduce(self, group=None) -> None:
        """Average C over data-parallel ranks exactly as DDP averages gradients (no-op when not distributed, and
        with ``through_grad``: FSDP2 has averaged C already)."""
        if self.through_grad or not (dist.is_available() and dist.is_initialized()):
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
        """Scale the actor's gradients; return ``clip_bias_norm``, ``pg_grad_norm``, ``clip_bias_scale``; reset C.
        With ``rescale=False`` the gradients are left alone and ``clip_bias_scale`` is not reported. (``measure``
        then ``scale_gradients`` is the same in two steps, for a scale applied after gradient clipping.)"""
        metrics = self.measure()
        if "clip_bias_scale" in metrics:
            self.scale_gradients(metrics["clip_bias_scale"])
        return metrics

    def measure(self) -> dict[str, torch.Tensor]:
        """``clip_bias_norm`` (||C||), ``pg_grad_norm`` (the actor's gradient norm now) and, with ``rescale``,
        ``clip_bias_scale`` = max(1, ||C|| / kappa); resets C. The gradients are not touched."""
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        bias_norm = global_norm(self._bias or [], device)
        grad_norm = global_norm([p.grad for p in self.parameters if p.grad is not None], device)
        self._bias = None
        if not self.rescale:
            return {"clip_bias_norm": bias_norm, "pg_grad_norm": grad_norm}
        return {"clip_bias_norm": bias_norm, "pg_grad_norm": grad_norm,
                "clip_bias_scale": torch.clamp(bias_norm / self.kappa, min=1.0)}

    def scale_gradients(self, scale: torch.Tensor) -> None:
        """Divide the actor's gradients by ``scale``."""
        for grad in (p.grad for p in self.parameters if p.grad is not None):
            local_tensor(grad).div_(scale.to(grad.dtype))


def changed_update(scale: float, grad_norm: float, max_grad_norm: float, order: str) -> bool:
    """Whether a clip-bias ``scale`` changed the gradient the optimizer receives, against what PPO hands it from
    the same gradient g (of norm ``grad_norm``, clipped to ``optimizer.max_grad_norm``). ``after_grad_clip``: whenever
    the scale exceeds 1. ``before_grad_clip``: only when g / scale falls under the clip threshold -- at or above it,
    clipping rescales both to the same vector of norm max_grad_norm."""
    if not scale > 1:
        return False
    return order == "after_grad_clip" or grad_norm / scale < max_grad_norm
