"""ST-PPO's clip-bias correction (docs/algorithms.md) as a verl training engine applies it: the policy loss hands
its bias surrogate ``agg(c_t * rho_t * A_t)`` to the engine (:func:`offer`), which takes C's share of every
micro-batch with ``torch.autograd.grad`` into buffers of its own (:class:`ClipBiasBuffers`), averages C over the
data-parallel ranks like the gradient and divides the gradient by ``max(1, ||C|| / kappa)`` before verl clips it.

Why not through ``.grad`` (as this project's own FSDP2 path does): with ``use_no_sync_for_gradient_accumulation``
on (the default of verl's engine config; verl's trainer config turns it off), verl's engine accumulates
micro-batches in FSDP2's no-sync mode, where the loss gradient of the micro-batches so far lives in FSDP's unsharded
buffers, out of reach of a parked ``.grad``; a second backward into ``.grad`` then mixes C into the loss gradient.
``autograd.grad`` leaves every ``.grad`` (sharded or not) alone, so both accumulation modes are right.

C's backward does not pass through the log-prob kernel. flash-attn's cross-entropy (which verl uses for the
log-probs where it is installed) overwrites the logits it saved with their gradient during its backward, so a
second backward through it reads garbage: verl's own ``loss.backward()`` must be the only one. The engine records
the kernel's logits and labels (:class:`KernelCall`), the gradient of the bias surrogate is taken down to the
kernel's output, turned into the gradient at the logits in closed form (:func:`log_prob_vjp`), and C's backward
starts from the logits. Without a recorded call (verl's fused kernels, which do not write their inputs) it starts
from the bias surrogate.

The leaves C is taken with respect to are the autograd leaves under the policy's log-probs: the parameters the
forward used, i.e. FSDP2's unsharded (all-gathered) parameters, or the module's own without FSDP. They are found by
walking the graph from the log-probs, the same walk on every micro-batch and rank, so C's buffers line up.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from stppo_agent.distributed.process_group import local_tensor

_state = threading.local()


class ClipBiasEngineMissingError(RuntimeError):
    """A preset with the clip-bias correction was selected, but no verl training engine applies it."""


def engine_missing_message(name: str, ratio_level: str) -> str:
    plain = "stppo_turn_ppo" if ratio_level == "turn" else "stppo_ppo"
    return (f"policy loss stppo_{name}: the {name} preset divides the policy gradient by its clip-bias norm, a step "
            "that needs the whole micro-batch gradient and so lives in a training engine, not in a loss, and this "
            "actor does not run the stppo engine. Select it with VERL_ENGINE_VENDOR=stppo in every worker's "
            "environment and actor strategy fsdp2 (`python -m stppo_agent.integrations.verl.settings "
            f"{name}` writes both; docs/verl.md), or use {plain} for the same {ratio_level}-level ratio without "
            "the correction, or this project's own trainer.")


class KernelCall(NamedTuple):
    """One call of the log-prob kernel: ``log_probs[i] = log_softmax(logits[i])[labels[i]]``."""

    logits: torch.Tensor
    labels: torch.Tensor
    log_probs: torch.Tensor


def log_prob_vjp(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor,
                 chunk_elements: int = 1 << 26) -> torch.Tensor:
    """The gradient at ``logits`` of ``sum(grad * log_softmax(logits)[labels])``: ``grad * (onehot - softmax)``, in
    float32 over chunks of rows (at most ``chunk_elements`` at a time), in the logits' dtype.

    >>> logits = torch.tensor([[0.0, 1.0], [2.0, 0.0]], requires_grad=True)
    >>> labels, grad = torch.tensor([1, 0]), torch.tensor([1.0, -2.0])
    >>> (expected,) = torch.autograd.grad((grad * logits.log_softmax(-1)[[0, 1], labels]).sum(), logits)
    >>> torch.allclose(log_prob_vjp(logits.detach(), labels, grad), expected)
    True
    """
    vocab = logits.shape[-1]
    flat_logits, flat_labels, flat_grad = logits.reshape(-1, vocab), labels.reshape(-1), grad.reshape(-1)
    out = torch.empty_like(flat_logits)
    rows = max(1, chunk_elements // vocab)
    with torch.no_grad():
        for start in range(0, flat_logits.shape[0], rows):
            part = slice(start, start + rows)
            values = -torch.softmax(flat_logits[part].float(), dim=-1)
            values.scatter_add_(-1, flat_labels[part, None], torch.ones_like(values[:, :1]))
            out[part] = values * flat_grad[part, None].float()
    return out.view(logits.shape)


def c_backward_roots(bias_surrogate: torch.Tensor, kernel_calls: Sequence[KernelCall]):
    """(roots, grad_outputs) of the backward that gives C: from the logits of the recorded kernel calls whose output
    leads to the surrogate, else (none does, or none was recorded) from the surrogate itself."""
    if kernel_calls:
        grads = torch.autograd.grad(bias_surrogate, [call.log_probs for call in kernel_calls], retain_graph=True,
                                    allow_unused=True)
        used = [(call, grad) for call, grad in zip(kernel_calls, grads) if grad is not None]
        if used:
            return ([call.logits for call, _ in used],
                    [log_prob_vjp(call.logits, call.labels, grad) for call, grad in used])
    return [bias_surrogate], None


@contextmanager
def collecting(sink: list):
    """While active on this thread, :func:`offer` appends ``(bias_surrogate, log_prob)`` to ``sink``."""
    previous = getattr(_state, "sink", None)
    _state.sink = sink
    try:
        yield sink
    finally:
        _state.sink = previous


def offer(name: str, ratio_level: str, bias_surrogate: torch.Tensor, log_prob: torch.Tensor) -> None:
    """Called by a policy loss with the correction: hand its surrogate to the engine, or refuse without one."""
    sink = getattr(_state, "sink", None)
    if sink is None:
        raise ClipBiasEngineMissingError(engine_missing_message(name, ratio_level))
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
    """C of one optimizer step, accumulated over micro-batches in float32 buffers of its own and averaged over the
    data-parallel ranks like the gradient. ``shard``: like verl's accumulation without no-sync, each micro-batch's C
    is reduce-scattered at once and each rank keeps 1/world of it (one flat shard); otherwise each rank keeps its
    whole, unsharded C until one all-reduce at the end of the step (the memory FSDP2 holds under no-sync)."""

    def __init__(self, kappa: float, group=None, shard: bool = False):
        if kappa <= 0:
            raise ValueError(f"kappa must be > 0, got {kappa}")
        self.kappa = kappa
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.shard = shard and self.world > 1
        self.shapes: list[torch.Size] | None = None
        self.buffers: list[torch.Tensor] = []  # unsharded: one per leaf; sharded: one flat shard

    def accumulate(self, bias_surrogate: torch.Tensor, log_prob: torch.Tensor,
                   kernel_calls: Sequence[KernelCall] = ()) -> None:
        """Add this micro-batch's C. Every rank calls it for every micro-batch: under FSDP the backward all-gathers
        parameters, a collective, so a rank with nothing clipped back-propagates zero through its log-probs.
        ``kernel_calls``: the log-prob kernel's calls of this micro-batch, where C's backward starts."""
        clipped = torch.tensor(float(bias_surrogate.requires_grad), device=log_prob.device)
        if self.world > 1:
            dist.all_reduce(clipped, group=self.group)
        if clipped.item() == 0:
            return
        if not bias_surrogate.requires_grad:
            bias_surrogate = log_prob.sum() * 0.0
        leaves = graph_leaves(log_prob)
        self._check_shapes([leaf.shape for leaf in leaves], log_prob.device)
        roots, grad_outputs = c_backward_roots(bias_surrogate, kernel_calls)
        grads = torch.autograd.grad(roots, leaves, grad_outputs=grad_outputs, retain_graph=True, allow_unused=True)
        if self.shard:
            grads = [self._scatter(leaves, grads)]
        else:
            grads = [torch.zeros(leaf.shape, dtype=torch.float32, device=leaf.device) if grad is None
                     else grad.to(torch.float32) for leaf, grad in zip(leaves, grads)]
        if not self.buffers:
            self.buffers = grads
        else:
            for total, grad in zip(self.buffers, grads):
                total.add_(grad)

    def _scatter(self, leaves, grads) -> torch.Tensor:
        """This rank's part of the micro-batch's C summed over ranks: one flat float32 reduce-scatter."""
        total = sum(leaf.numel() for leaf in leaves)
        flat = torch.zeros(total + (-total % self.world), dtype=torch.float32, device=leaves[0].device)
        offset = 0
        for leaf, grad in zip(leaves, grads):
            if grad is not None:
                flat[offset:offset + leaf.numel()].copy_(grad.reshape(-1))
            offset += leaf.numel()
        part = flat.new_empty(flat.numel() // self.world)
        dist.reduce_scatter_tensor(part, flat, op=dist.ReduceOp.SUM, group=self.group)
        return part

    def _check_shapes(self, shapes: list[torch.Size], device) -> None:
        """The same leaves on every micro-batch, and (checked once) on every rank: C's entries must line up."""
        if self.shapes is not None:
            if shapes != self.shapes:
                raise RuntimeError("clip-bias correction: the policy's parameters differ between micro-batches")
            return
        self.shapes = shapes
        if self.world > 1:
            sizes = torch.tensor([float(len(shapes)), float(sum(s.numel() for s in shapes))], device=device)
            low, high = sizes.clone(), sizes.clone()
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
            if not torch.equal(low, high):
                raise RuntimeError("clip-bias correction: ranks disagree on the parameters C is taken over")

    def norm(self) -> torch.Tensor:
        """||C|| of the global batch, then reset. Zero without a further collective when nothing clipped on any rank
        (the decision to take C, one scalar all-reduce per micro-batch in :meth:`accumulate`, is the same on every
        rank, so either all ranks hold buffers or none does)."""
        buffers, self.buffers, self.shapes = self.buffers, [], None
        if not buffers:
            return torch.zeros(())
        if self.shard:  # each rank holds a disjoint part of the summed C
            squares = (buffers[0] / self.world).square().sum()
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.group)
            return torch.sqrt(squares)
        if self.world > 1:
            for total in buffers:
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
                total.div_(self.world)
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
