"""ST-PPO's clip-bias correction (docs/algorithms.md) as a verl training engine applies it: the policy loss hands
its bias surrogate ``agg(c_t * rho_t * A_t)`` to the engine (:func:`offer`), which takes C's share of every
micro-batch with ``torch.autograd.grad`` into buffers of its own (:class:`ClipBiasBuffers`), averages C over the
data-parallel ranks like the gradient and divides the gradient by ``max(1, ||C|| / kappa)`` before verl clips it.

Why not through ``.grad`` (as this project's own FSDP2 path does): verl's engine accumulates micro-batches with
FSDP2's no-sync mode by default, where the loss gradient of the micro-batches so far lives in FSDP's unsharded
buffers, out of reach of a parked ``.grad``; a second backward into ``.grad`` then mixes C into the loss gradient.
``autograd.grad`` leaves every ``.grad`` (sharded or not) alone, so both accumulation modes are right.

The leaves C is taken with respect to are the autograd leaves under the policy's log-probs: the parameters the
forward used, i.e. FSDP2's unsharded (all-gathered) parameters, or the module's own without FSDP. They are found by
walking the graph from the log-probs, the same walk on every micro-batch and rank, so C's buffers line up.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

from stppo_agent.distributed.process_group import local_tensor

_state = threading.local()


class ClipBiasEngineMissingError(RuntimeError):
    """A preset with the clip-bias correction was selected, but no verl training engine applies it."""


def engine_missing_message(name: str) -> str:
    return (f"policy loss stppo_{name}: the {name} preset divides the policy gradient by its clip-bias norm, a step "
            "that needs the whole micro-batch gradient and so lives in a training engine, not in a loss, and this "
            "actor does not run the stppo engine. Select it with VERL_ENGINE_VENDOR=stppo in every worker's "
            "environment and actor strategy fsdp2 (`python -m stppo_agent.integrations.verl.settings "
            f"{name}` writes both; docs/verl.md), or use stppo_turn_ppo (stppo_grpo for "
            "so_grpo's update without the correction) for the same ratio without it, or this project's own trainer.")


@contextmanager
def collecting(sink: list):
    """While active on this thread, :func:`offer` appends ``(bias_surrogate, log_prob)`` to ``sink``."""
    previous = getattr(_state, "sink", None)
    _state.sink = sink
    try:
        yield sink
    finally:
        _state.sink = previous


def offer(name: str, bias_surrogate: torch.Tensor, log_prob: torch.Tensor) -> None:
    """Called by a policy loss with the correction: hand its surrogate to the engine, or refuse without one."""
    sink = getattr(_state, "sink", None)
    if sink is None:
        raise ClipBiasEngineMissingError(engine_missing_message(name))
    sink.append((bias_surrogate, log_prob))


def graph_leaves(root: torch.Tensor) -> list[torch.Tensor]:
    """The leaves requiring grad under ``root``, in a fixed depth-first order of the graph (so the same model code
    gives the same order on every micro-batch and rank)."""
    leaves, seen, stack = [], set(), [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            leaves.append(variable)
            continue
        stack.extend(next_node for next_node, _ in reversed(node.next_functions))
    return leaves


class ClipBiasBuffers:
    """C of one optimizer step: accumulated over micro-batches in float32 buffers of its own, then all-reduced."""

    def __init__(self, kappa: float, group=None):
        if kappa <= 0:
            raise ValueError(f"kappa must be > 0, got {kappa}")
        self.kappa = kappa
        self.group = group
        self.buffers: list[torch.Tensor] | None = None

    def accumulate(self, bias_surrogate: torch.Tensor, log_prob: torch.Tensor) -> None:
        """Add this micro-batch's C. Every rank calls it for every micro-batch: under FSDP the backward all-gathers
        parameters, a collective, so a rank with nothing clipped back-propagates zero through its log-probs."""
        clipped = torch.tensor(float(bias_surrogate.requires_grad), device=log_prob.device)
        if self._distributed():
            dist.all_reduce(clipped, group=self.group)
        if clipped.item() == 0:
            return
        if not bias_surrogate.requires_grad:
            bias_surrogate = log_prob.sum() * 0.0
        leaves = graph_leaves(log_prob)
        grads = torch.autograd.grad(bias_surrogate, leaves, retain_graph=True, allow_unused=True)
        if self.buffers is None:
            self.buffers = [torch.zeros(leaf.shape, dtype=torch.float32, device=leaf.device) for leaf in leaves]
        if [b.shape for b in self.buffers] != [leaf.shape for leaf in leaves]:
            raise RuntimeError("clip-bias correction: the policy's parameters differ between micro-batches")
        for total, grad in zip(self.buffers, grads):
            if grad is not None:
                total.add_(grad.to(torch.float32))

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def norm(self) -> torch.Tensor:
        """||C|| of the global batch: the buffers averaged over ranks like the gradient (then reset)."""
        buffers, self.buffers = self.buffers or [], None
        if self._distributed():
            world = dist.get_world_size(self.group)
            sizes = torch.tensor([float(len(buffers)), float(sum(b.numel() for b in buffers))])
            if buffers:
                sizes = sizes.to(buffers[0].device)
            low, high = sizes.clone(), sizes.clone()
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
            if not torch.equal(low, high):
                raise RuntimeError("clip-bias correction: ranks disagree on the parameters C is taken over")
            for total in buffers:
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
                total.div_(world)
        if not buffers:
            return torch.zeros(())
        return torch.sqrt(sum(total.square().sum() for total in buffers))

    def scale_gradients(self, parameters) -> dict[str, float]:
        """Divide every ``.grad`` of ``parameters`` (sharded or not) by max(1, ||C|| / kappa); the step's metrics."""
        bias_norm = self.norm()
        scale = torch.clamp(bias_norm / self.kappa, min=1.0)
        for param in parameters:
            if param.grad is not None:
                grad = local_tensor(param.grad)
                grad.div_(scale.to(device=grad.device, dtype=grad.dtype))
        return {"clip_bias_norm": float(bias_norm), "clip_bias_scale": float(scale)}
