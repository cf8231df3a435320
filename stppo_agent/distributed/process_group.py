"""torch.distributed plumbing for data-parallel training (torchrun; gloo on CPU, NCCL on GPUs).

Every rank runs its share of the rollouts and of the update; loss normalisers (policy-token counts) are global,
so that one data-parallel step computes exactly the gradient of the whole global batch. Two strategies:

- ``ddp``: every rank holds the whole model; DDP averages gradients, :meth:`ClipBiasCorrector.all_reduce`
  averages the clip-bias gradient C the same way.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every transformer block and on the root, so parameters,
  gradients and AdamW state are split over the ranks; gradients (C included) arrive reduce-scattered and
  averaged in ``.grad`` as DTensor shards.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist


def init_from_env() -> bool:
    """Join the process group torchrun describes (WORLD_SIZE > 1); returns whether training is distributed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return dist.is_initialized()
    dist.init_process_group(backend=_backend())
    return True


@contextlib.contextmanager
def process_group_for_command():
    """Join torchrun's process group (:func:`init_from_env`) for a command, and leave it when the command ends
    normally. Leaving matters: a process that exits still holding a gloo group can abort at interpreter shutdown
    ("terminate called without an active exception", SIGABRT) when its connection threads are torn down while
    another rank exits, failing a run that finished. After an error the group is left as it is: other ranks may
    still be inside a collective, and torchrun stops them."""
    init_from_env()
    if dist.is_initialized() and not faulthandler.is_enabled():  # (pytest enables its own)
        faulthandler.enable()  # a rank that aborts in C++ prints where its Python threads were (stderr)
    yield
    if dist.is_initialized():
        # The command's objects go first, while the interpreter is whole: a trainer sits in reference cycles, and its
        # DDP model's reducer holds the group, so without a collection here the group would outlive
        # destroy_process_group and gloo's worker threads be torn down in interpreter finalization -- a rare abort
        # of a finished run, which a barrier alone does not prevent.
        gc.collect()
        # Every rank is done talking before any tears gloo down: a rank that leaves first, while another is still
        # writing its summary, can abort in its teardown.
        dist.barrier()
        dist.destroy_process_group()


def _backend() -> str:
    """NCCL on GPUs (after binding this process to its GPU), gloo on CPU."""
    if not torch.cuda.is_available():
        return "gloo"
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return "nccl"


STRATEGIES = ("ddp", "fsdp2")


def ensure_process_group() -> None:
    """A process group even for one process: FSDP2 needs a device mesh, also a one-way one."""
    if dist.is_initialized():
        return
    if "MASTER_ADDR" in os.environ:  # torchrun (any world size)
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        init_from_env() if int(os.environ["WORLD_SIZE"]) > 1 else _init_single("env://")
        return

    _init_single(f"tcp://127.0.0.1:{free_port()}")


def _init_single(init_method: str) -> None:
    dist.init_process_group(backend=_backend(), init_method=init_method, rank=0, world_size=1)


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


def shard_fsdp2(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``fully_shard`` each transformer block (the classes Hugging Face lists in ``_no_split_modules``), then the
    root (embeddings, final norm, heads). Blocks free their gathered weights after forward; the root keeps its
    own, which backward needs at once. Call on a model already on its device, before building its optimizer.
    ``compute_dtype``: gather and compute in it, keep master weights as they are, reduce gradients in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype \
        else MixedPrecisionPolicy()

    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in block_names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no transformer block class in _no_split_modules "
                         f"({sorted(block_names)}); FSDP2 needs one to shard layer by layer: use strategy=ddp")
    for block in blocks:
        fully_shard(block, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, reshard_after_forward=False, mp_policy=policy)
    return model


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """Hold an FSDP2 model's full weights for the duration (a no-op for other models).

    Generation runs a different number of forwards on every rank (episodes end at different turns and
    lengths); a sharded forward is a collective, so ranks would wait on each other forever. With every block
    gathered up front and not freed after forward, forwards involve no communication. Memory: the full
    weights in their training dtype, once, for the duration -- not the optimizer state or gradients.
    """
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        yield model
        return
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield model
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(module is not model, recurse=False)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def global_norm(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 2-norm of all ``tensors`` together; DTensor shards are summed over ranks (each holds a disjoint part).
    Half-precision values are normed in float32; float64 stays float64 (exactness in tests)."""
    from torch.distributed.tensor import DTensor

    if not tensors:
        return torch.zeros((), device=device)
    squares = [torch.linalg.vector_norm(local_tensor(t).to(torch.float64 if t.dtype == torch.float64
                                                             else torch.float32)) ** 2 for t in tensors]
    dtype = torch.float64 if any(s.dtype == torch.float64 for s in squares) else torch.float32
    total = torch.stack([s.to(dtype) for s in squares]).sum()
    if any(isinstance(t, DTensor) for t in tensors) and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.sqrt()


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for plain and FSDP2-sharded parameters alike; returns the total norm as a plain tensor."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


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


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s sampling streams (generation, and anything else drawn from torch's, Python's
    and NumPy's global generators): ``seed`` itself on rank 0, so one process samples exactly as it always did;
    elsewhere a 32-bit seed derived from (seed, rank) by NumPy's SeedSequence, so that ranks draw different
    tokens and rank r of seed s does not repeat rank 0 of another seed (as ``seed + rank`` would)."""
    if rank == 0:
        return seed
    return int(np.random.SeedSequence([seed % 2**64, rank]).generate_state(1)[0])


def seed_everything(seed: int) -> None:
    """Seed torch (every device), Python's ``random`` and NumPy's global generator with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def free_port() -> int:
    """An unused TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
