"""Mixed precision by autocast for single-process and DDP training (FSDP2 has its own: fsdp_compute_dtype).

`autocast_dtype=bfloat16` runs every forward pass of the actor, critic and reference -- generation, scoring and
training -- under ``torch.autocast``, while weights, gradients and AdamW state stay in float32 (TRL's and
accelerate's ``bf16=True``). It pays on GPUs and on CPUs with AMX; on an AVX512-BF16 CPU without AMX it measured
0.85x float32's speed (``benchmarks/precision.py``), hence ``auto``'s rule below.

float16 is refused for training (weights, autocast, FSDP2 compute): its 5 exponent bits underflow the small
gradients of a loss divided by the trainer's global token count (at a normaliser of 1e6 the float16 gradient's
relative error was 0.68, bfloat16's 0.012; at 1e8, 18 weight tensors got all-zero gradients), and training in it
needs a loss scaler with skip-on-overflow (``torch.amp.GradScaler``), which stppo does not have. bfloat16 has
float32's exponent range and needs none. Evaluation (``hf:`` agents) may still load float16 weights: no gradient.

The output head (LM head, value head) runs outside autocast, in float32: logits of magnitude ~20 rounded to
bfloat16 carry ~0.05 of error each, which would reach every log-prob and with it every importance ratio (the
on-policy ratios would leave 1 by noise alone). The head is a small share of the compute.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTOCAST_DTYPES = ("bfloat16", "auto")
FLOAT16_REFUSED = ("float16 trains only with a loss scaler (gradients of a loss divided by the global token count "
                   "underflow to zero in it), which stppo does not have; use bfloat16 (float32's range, no scaler "
                   "needed) or float32")


def refuse_float16_training(setting: str, value: str | None) -> None:
    """One-line refusal of float16 for a precision setting of a run that takes gradients."""
    if value == "float16":
        raise ValueError(f"{setting}=float16 is refused for training: {FLOAT16_REFUSED}")


def validate_autocast_dtype(name: str | None, weights_dtype: str) -> None:
    """The precision settings of a training run (``stppo train`` and ``stppo sft``): no float16 anywhere."""
    refuse_float16_training("dtype", weights_dtype)
    if name is None:
        return
    refuse_float16_training("autocast_dtype", name)
    if name not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast_dtype must be {', '.join(AUTOCAST_DTYPES)} (or unset), got {name!r}")
    if weights_dtype != "float32":
        raise ValueError(f"autocast_dtype={name} needs dtype=float32 weights (got dtype={weights_dtype}): autocast "
                         f"keeps float32 master weights and computes in {name}")


def resolve_autocast_dtype(name: str | None, device: torch.device) -> str | None:
    """``auto``: bfloat16 where it is faster than float32 -- a GPU that supports it, a CPU with AMX (its bfloat16
    matrix tiles) -- else None (float32). AVX512-BF16 alone is not enough: there bfloat16 autocast measured 0.85x
    float32's speed (the conversions around every matmul cost more than its dot-product instructions save), and
    on older CPUs bfloat16 is emulated."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else None
    if device.type == "cpu":
        return "bfloat16" if cpu_has_amx_bf16() else None
    return None


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux); None where the file does not exist."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return None
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[-1].split()}


def cpu_has_amx_bf16() -> bool:
    flags = cpu_flags()
    if flags is not None:
        return "amx_bf16" in flags
    # elsewhere torch's private probe (absent in some versions: then float32, the safe side)
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def with_resolved_precision(config, device: torch.device):
    """``config`` (a dataclass with ``autocast_dtype``, or with a ``precision`` section that has it) with ``auto``
    resolved for ``device``: the run's config.yaml then records the precision chosen, so that a resume or replay on
    other hardware computes the same."""
    if hasattr(config, "precision"):
        return dataclasses.replace(config, precision=with_resolved_precision(config.precision, device))
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


def independent_copy(model: torch.nn.Module, dtype_name: str | None) -> torch.nn.Module:
    """A deep copy of ``model`` whose forward runs on the copy's own weights, with the same autocast. A plain
    ``copy.deepcopy`` would not do: the wrappers :func:`autocast_forward` puts on the instance close over the
    original's bound forward, so the copy would silently compute with the original's weights."""
    clone = copy.deepcopy(model)
    for module in clone.modules():
        module.__dict__.pop("forward", None)  # back to the class's forward, bound to the copy
    return autocast_forward(clone, dtype_name)


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
