"""torch.distributed plumbing for data-parallel training (torchrun; gloo on CPU, NCCL on GPUs).

Every rank runs its share of the rollouts and of the update; gradients are averaged by DDP, the clip-bias
gradient C by :meth:`ClipBiasCorrector.all_reduce`, and loss normalisers (policy-token counts) are global, so
that one data-parallel step computes exactly the gradient of the whole global batch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_from_env() -> bool:
    """Join the process group torchrun describes (WORLD_SIZE > 1); returns whether training is distributed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return dist.is_initialized()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)
    return True


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (the identity when not distributed); returns a new tensor."""
    value = value.clone()
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP around ``model`` when distributed, else ``model`` itself."""
    if not dist.is_initialized():
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def distributed_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whitening with the mean and unbiased variance of the masked entries of *all* ranks."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    stats = torch.stack([torch.where(mask, x, zero).sum(), mask.sum().to(x.dtype)])
    total, count = all_reduce_sum(stats)
    mean = total / count.clamp(min=1)
    centered = torch.where(mask, x - mean, zero)
    var = all_reduce_sum((centered**2).sum()) / (count - 1).clamp(min=1)
    return centered * torch.rsqrt(var + eps)


def all_gather_objects(value) -> list:
    """Every rank's ``value`` (any picklable object), in rank order."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
