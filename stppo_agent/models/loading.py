"""Actor, critic and reference models: any Hugging Face causal LM, loaded from a local folder or the hub.

- actor: ``AutoModelForCausalLM``.
- critic: ``AutoModelForTokenClassification`` with one label -- a value head on the same backbone, the way verl
  builds critics -- so a critic checkpoint is a plain Hugging Face folder too. Initialised from the actor's
  weights (the head is new) or from a separate model.
- reference: a frozen copy of the actor's initial weights, loaded only when a KL term needs it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from stppo_agent.models.precision import DTYPES, autocast_forward


@dataclasses.dataclass
class PolicyModels:
    actor: torch.nn.Module
    tokenizer: object
    critic: torch.nn.Module | None
    reference: torch.nn.Module | None


def resolve_device(name: str) -> torch.device:
    """``auto`` and plain ``cuda`` mean this process's GPU (torchrun's LOCAL_RANK), not always GPU 0."""
    if name == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    if name in ("auto", "cuda"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def enable_checkpointing(model) -> None:
    """Activation (gradient) checkpointing under its current transformers name. Non-reentrant: the clip-bias
    correction's ``torch.autograd.grad`` does not work through reentrant checkpoints."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def is_checkpointing(model) -> bool:
    return bool(getattr(model, "is_activation_checkpointing", None) if hasattr(model, "is_activation_checkpointing")
                else model.is_gradient_checkpointing)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        raise FileNotFoundError(f"cannot load a tokenizer from {path!r} (a local folder or hub name): {exc}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_actor(path: str | os.PathLike, dtype: str = "float32", gradient_checkpointing: bool = False):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_dtype(dtype))
    except OSError as exc:
        raise FileNotFoundError(f"cannot load a causal LM from {path!r} (a local folder or hub name): {exc}") from exc
    if gradient_checkpointing:
        enable_checkpointing(model)
        model.config.use_cache = False
    return model


def load_critic(path: str | os.PathLike, dtype: str = "float32", gradient_checkpointing: bool = False):
    """A one-label token-classification model on ``path``'s backbone; a fresh value head when ``path`` is an LM."""
    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "lm_head unused / score newly initialised" report is expected here
    try:
        model = AutoModelForTokenClassification.from_pretrained(str(path), num_labels=1, dtype=_dtype(dtype))
    except OSError as exc:
        raise FileNotFoundError(f"cannot load a critic from {path!r}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    if not (Path(str(path)) / "critic.json").exists():
        # A new value head starts at zero output: the first advantages are then the plain returns, not noise.
        head = getattr(model, "score", None) or getattr(model, "classifier", None)
        if head is not None:
            torch.nn.init.zeros_(head.weight)
            if getattr(head, "bias", None) is not None:
                torch.nn.init.zeros_(head.bias)
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model


def save_critic(critic, path: Path, state_dict: dict | None = None) -> None:
    critic.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
    (path / "critic.json").write_text('{"kind": "value-head", "num_labels": 1}\n')


def save_policy(folder: Path, actor, tokenizer, critic=None, actor_state: dict | None = None,
                critic_state: dict | None = None) -> None:
    """``folder/actor`` (a Hugging Face folder with the tokenizer) and ``folder/critic``: how checkpoints and recorded
    initial weights store a policy. ``*_state``: full state dicts to write instead of the modules' own (gathered
    from FSDP2 shards, or cast for the disk)."""
    actor.save_pretrained(folder / "actor", state_dict=actor_state, safe_serialization=True)
    tokenizer.save_pretrained(folder / "actor")
    if critic is not None:
        save_critic(critic, folder / "critic", critic_state)


def load_reference(path: str | os.PathLike, dtype: str = "float32"):
    model = load_actor(path, dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def load_policy_models(actor_path: str, *, critic_path: str | None, use_critic: bool, need_reference: bool,
                       dtype: str = "float32", gradient_checkpointing: bool = False,
                       reference_path: str | None = None, autocast_dtype: str | None = None) -> PolicyModels:
    """Everything a run needs, from Hugging Face folders or names (forwards under autocast when asked)."""

    tokenizer = load_tokenizer(actor_path)
    actor = load_actor(actor_path, dtype, gradient_checkpointing)
    critic = load_critic(critic_path or actor_path, dtype, gradient_checkpointing) if use_critic else None
    reference = load_reference(reference_path or actor_path, dtype) if need_reference else None
    actor, critic, reference = (autocast_forward(model, autocast_dtype) if model is not None else None
                                for model in (actor, critic, reference))
    return PolicyModels(actor, tokenizer, critic, reference)
