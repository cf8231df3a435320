"""The vLLM backend's request building, output parsing and weight sync, without vLLM or a GPU."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from stppo_agent.rollouts.sampling import SamplingSettings
from stppo_agent.rollouts.vllm_generation import (
    INSTALL_HINT,
    VLLMGenerationBackend,
    generations_from_outputs,
    sampling_kwargs,
    token_prompts,
    weight_items,
)


def test_sampling_kwargs_match_the_hf_backend():
    sampled = sampling_kwargs(SamplingSettings(temperature=0.7, top_p=0.9), 64, ["</search>", "</answer>"], seed=3)
    assert sampled == {"max_tokens": 64, "stop": ["</search>", "</answer>"], "include_stop_str_in_output": True,
                       "logprobs": 0, "skip_special_tokens": False, "detokenize": True, "temperature": 0.7,
                       "top_p": 0.9, "top_k": -1, "seed": 3, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                       "frequency_penalty": 0.0, "min_p": 0.0}
    assert sampling_kwargs(SamplingSettings(top_k=20), 8, [])["top_k"] == 20
    greedy = sampling_kwargs(SamplingSettings(greedy=True), 8, [])
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy and "seed" not in greedy
    assert greedy["repetition_penalty"] == 1.0  # greedy too: a penalty would change which token is the argmax


def test_prompts_are_token_ids():
    assert token_prompts([[1, 2, 3], (4,)]) == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4]}]


def test_outputs_become_generations_with_sampled_logprobs():
    def logprob(value):
        return SimpleNamespace(logprob=value)

    output = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5, 9], logprobs=[{5: logprob(-0.1), 7: logprob(-3.0)},
                                                                                   {9: logprob(-0.2)}])])
    missing = SimpleNamespace(outputs=[SimpleNamespace(token_ids=(4,), logprobs=None)])
    first, second = generations_from_outputs([output, missing])
    assert first.token_ids == [5, 9] and first.logprobs == [-0.1, -0.2]
    assert second.token_ids == [4] and second.logprobs[0] != second.logprobs[0]  # NaN when not reported


def test_weight_items_use_hf_names_and_chunk():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    wrapped = torch.nn.Module()
    wrapped.module = model
    chunks = list(weight_items(wrapped, chunk_bytes=64))
    names = [name for chunk in chunks for name, _ in chunk]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias"] and len(chunks) > 1
    assert all(not tensor.requires_grad for chunk in chunks for _, tensor in chunk)


def test_sync_weights_loads_every_tensor_into_the_engine_model():
    loaded = []
    engine_model = SimpleNamespace(load_weights=lambda weights: loaded.extend(name for name, _ in weights))
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=engine_model))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(model_executor=SimpleNamespace(
        driver_worker=SimpleNamespace(worker=worker))), reset_prefix_cache=lambda: loaded.append("reset"))
    backend = VLLMGenerationBackend.__new__(VLLMGenerationBackend)
    backend.llm = llm
    backend.sync_weights(torch.nn.Linear(3, 3))
    assert loaded == ["weight", "bias", "reset"]


def test_sync_weights_goes_through_apply_model_when_vllm_has_it():
    """vLLM >= 0.9 (checked against 0.33): ``LLM.apply_model(func)`` runs ``func`` on each worker's model."""
    loaded = []
    engine_model = SimpleNamespace(load_weights=lambda weights: loaded.extend(name for name, _ in weights))
    llm = SimpleNamespace(apply_model=lambda func: [func(engine_model)],
                          reset_prefix_cache=lambda: loaded.append("reset"))
    backend = VLLMGenerationBackend.__new__(VLLMGenerationBackend)
    backend.llm = llm
    backend.sync_weights(torch.nn.Linear(3, 3))
    assert loaded == ["weight", "bias", "reset"]


def test_engine_defaults_ask_for_processed_logprobs_only_where_known():
    import dataclasses

    from stppo_agent.rollouts.vllm_generation import engine_defaults

    @dataclasses.dataclass
    class NewArgs:
        logprobs_mode: str = "raw_logprobs"

    @dataclasses.dataclass
    class OldArgs:
        model: str = ""

    @dataclasses.dataclass
    class CurrentArgs:
        logprobs_mode: str = "raw_logprobs"
        generation_config: str = "auto"

    assert engine_defaults(SimpleNamespace(EngineArgs=NewArgs)) == {"logprobs_mode": "processed_logprobs"}
    assert engine_defaults(SimpleNamespace(EngineArgs=OldArgs)) == {}
    # the checkpoint's generation_config would set vLLM's default sampling parameters: vLLM's own instead
    assert engine_defaults(SimpleNamespace(EngineArgs=CurrentArgs)) == {"logprobs_mode": "processed_logprobs",
                                                                        "generation_config": "vllm"}


def fake_vllm(monkeypatch, **engine_fields):
    """A stand-in ``vllm`` module whose ``LLM`` records the engine options it was built with."""
    import dataclasses
    import sys

    args = dataclasses.make_dataclass("EngineArgs", [(name, str, value) for name, value in engine_fields.items()])
    built = {}
    module = SimpleNamespace(EngineArgs=args, __version__="0.0-test", LLM=lambda **kwargs: built.update(kwargs))
    monkeypatch.setitem(sys.modules, "vllm", module)
    return built


def test_the_engine_reports_the_sampled_distributions_logprobs(monkeypatch):
    import warnings

    built = fake_vllm(monkeypatch, logprobs_mode="raw_logprobs", generation_config="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        VLLMGenerationBackend("m", SamplingSettings(temperature=0.7, top_p=0.9))
    assert built["logprobs_mode"] == "processed_logprobs" and built["generation_config"] == "vllm"


def test_a_vllm_without_logprobs_mode_is_named_when_the_settings_reshape_the_distribution(monkeypatch):
    import warnings

    fake_vllm(monkeypatch, model="")
    with pytest.warns(UserWarning, match="no logprobs_mode"):
        VLLMGenerationBackend("m", SamplingSettings(temperature=0.7))
    with warnings.catch_warnings():  # temperature 1, no truncation: raw and processed log-probs are the same
        warnings.simplefilter("error")
        VLLMGenerationBackend("m", SamplingSettings())


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed: nothing to refuse")
def test_missing_vllm_gives_an_install_hint(tmp_path):
    with pytest.raises(ImportError, match="pip install 'stppo\\[vllm\\]'"):
        VLLMGenerationBackend(str(tmp_path))
    assert "GPU" in INSTALL_HINT
