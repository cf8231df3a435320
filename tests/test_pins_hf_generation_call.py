"""How ``HFGenerationBackend`` calls ``model.generate``: under the sampler's autocast (``generation_autocast_dtype``)
and none without it, unsynced, with the project's generation config and a cache laid out for the model."""

from __future__ import annotations

import pytest
import torch

from stppo_agent.models.tiny import tiny_generation_model
from stppo_agent.rollouts.hf_generation import HFGenerationBackend


@pytest.fixture(scope="module")
def tiny():
    return tiny_generation_model()


def _autocast_seen(model, backend) -> set:
    seen = set()
    handle = model.register_forward_pre_hook(
        lambda module, args: seen.add(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None))
    try:
        torch.manual_seed(0)
        backend.generate([[3, 4], [5]], 3)
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("name, dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16), (None, None)])
def test_generation_runs_under_the_samplers_autocast_and_only_then(tiny, name, dtype):
    model, tok = tiny
    backend = HFGenerationBackend(model, tok, stop_strings=(), autocast_dtype=name)
    assert backend.autocast_dtype is dtype
    assert _autocast_seen(model, backend) == {dtype}
    assert torch.is_autocast_enabled("cpu") is False  # left on exit


def test_generate_is_called_unsynced_with_the_projects_config_and_a_cache_for_the_models_layers(tiny, monkeypatch):
    """Ranks generate independently (``synced_gpus=False``: transformers' None would lock-step FSDP ranks), rows
    are padded with the tokenizer's pad id, and the fresh cache is laid out for this model's config (its sliding
    or full attention layers)."""
    import stppo_agent.rollouts.hf_generation as hf_generation

    model, tok = tiny
    calls, caches = [], []
    real_generate, real_new_cache = model.generate, hf_generation.new_cache
    monkeypatch.setattr(model, "generate", lambda **kw: calls.append(kw) or real_generate(**kw))
    monkeypatch.setattr(hf_generation, "new_cache", lambda config: caches.append(config) or real_new_cache(config))
    backend = HFGenerationBackend(model, tok, stop_strings=())
    torch.manual_seed(0)
    backend.generate([[3, 4], [5]], 3)
    [kw] = calls
    assert kw["synced_gpus"] is False
    assert kw["generation_config"].pad_token_id == tok.pad_token_id == 0
    assert kw["generation_config"].eos_token_id == [1] and kw["generation_config"].max_new_tokens == 3
    assert caches == [model.config]


def test_without_cache_reuse_no_turn_state_is_built(tiny, monkeypatch):
    import stppo_agent.rollouts.hf_generation as hf_generation

    model, tok = tiny
    built = []
    real = hf_generation.after_generate
    monkeypatch.setattr(hf_generation, "after_generate", lambda *a: built.append(1) or real(*a))
    torch.manual_seed(0)
    HFGenerationBackend(model, tok, stop_strings=(), reuse_cache=False).generate([[3, 4], [5]], 2, keys=["a", "b"])
    assert built == []
    HFGenerationBackend(model, tok, stop_strings=(), reuse_cache=True).generate([[3, 4], [5]], 2, keys=["a", "b"])
    assert built == [1]
