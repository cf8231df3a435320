"""Mixed precision by autocast for single-process and DDP training (FSDP2 has its own: fsdp_compute_dtype).

`autocast_dtype=bfloat16` runs every forward pass of the actor, critic and reference -- generation, scoring and
training -- under ``torch.autocast``, while weights, gradients and AdamW state stay in float32 (TRL's and
accelerate's ``bf16=True``). On CPUs with AVX512-BF16 or AMX and on GPUs it is 2-3x faster (measured on this
project's 2-core CPU: SmolLM2-135M forward+backward 2.6x).

The output head (LM head, value head) runs outside autocast, in float32: logits of magnitude ~20 rounded to
bfloat16 carry ~0.05 of error each, which would reach every log-prob and with it every importance ratio (the
on-policy ratios would leave 1 by noise alone). The head is a small share of the compute.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .models import DTYPES

AUTOCAST_DTYPES = ("bfloat16", "float16", "auto")


def validate_autocast_dtype(name: str | None, weights_dtype: str) -> None:
    if name is None:
        return
    if name not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast_dtype must be {', '.join(AUTOCAST_DTYPES)} (or unset), got {name!r}")
    if weights_dtype != "float32":
        raise ValueError(f"autocast_dtype={name} needs dtype=float32 weights (got dtype={weights_dtype}): autocast "
                         f"keeps float32 master weights and computes in {name}")


def resolve_autocast_dtype(name: str | None, device: torch.device) -> str | None:
    """``auto``: bfloat16 where the hardware computes it natively (a GPU that supports it; a CPU with AVX512-BF16
    or AMX), else None -- emulated bfloat16 on an older CPU is slower than float32."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else None
    if device.type == "cpu":
        native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or \
            getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()  # private probes: absent -> float32
        return "bfloat16" if native else None
    return None


def with_resolved_precision(config, device: torch.device):
    """``config`` (any dataclass with ``autocast_dtype``) with ``auto`` resolved for ``device``: the run's
    config.yaml then records the precision chosen, so that a resume or replay on other hardware computes the same."""
    return dataclasses.replace(config, autocast_dtype=resolve_autocast_dtype(config.autocast_dtype, device))


def autocast_forward(model: torch.nn.Module, dtype_name: str | None) -> torch.nn.Module:
    """Make ``model``'s forward run under autocast in ``dtype_name`` (no-op for None), its output head in float32.

    The forward is wrapped on the instance rather than around call sites so that every caller -- ``generate``, the
    scoring and training passes, DDP -- gets it; ``functools.wraps`` keeps the signature that ``generate`` inspects.
    Backward passes run outside the wrapper, as torch recommends.
    """
    if dtype_name is None:
        return model
    dtype = DTYPES[dtype_name]
    forward = model.forward

    @functools.wraps(forward)
    def forward_under_autocast(*args, **kwargs):
        with torch.autocast(_device_type(model), dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = forward_under_autocast
    head = _output_head(model)
    if head is not None:
        _run_in_float32(head)
    return model


def _device_type(model: torch.nn.Module) -> str:
    return next(model.parameters()).device.type


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:  # value heads of AutoModelForTokenClassification
        head = getattr(model, "score", None) or getattr(model, "classifier", None)
    return head if isinstance(head, torch.nn.Module) else None


def _run_in_float32(head: torch.nn.Module) -> None:
    forward = head.forward

    @functools.wraps(forward)
    def forward_in_float32(hidden: torch.Tensor, *args, **kwargs):
        with torch.autocast(hidden.device.type, enabled=False):
            return forward(hidden.float(), *args, **kwargs)

    head.forward = forward_in_float32
