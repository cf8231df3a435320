"""``generation_backend``: the lagged policy's model and the run's sampling, generation batch size, cache reuse and
sampler autocast go to ``HFGenerationBackend``; vLLM samples in the run's dtype (bfloat16 for a float32 run)."""

from __future__ import annotations

from types import SimpleNamespace

import stppo_agent.training.model_setup as model_setup
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.config_sections import PrecisionConfig, RolloutConfig


def test_the_hf_backend_gets_the_run_settings(monkeypatch):
    made = []
    monkeypatch.setattr(model_setup, "HFGenerationBackend", lambda *args, **kw: made.append((args, kw)) or "backend")
    cfg = TrainConfig(model="m", env="stppo/Toy-v0",
                      rollout=RolloutConfig(temperature=0.5, generation_batch_size=3, reuse_kv_cache=False),
                      precision=PrecisionConfig(generation_autocast_dtype="bfloat16"))
    assert model_setup.generation_backend(cfg, "lagged", "tok", 0, None) == "backend"
    [(args, kw)] = made
    assert args[:2] == ("lagged", "tok") and args[2] == cfg.sampling() and args[2].temperature == 0.5
    assert kw == {"batch_size": 3, "reuse_cache": False, "autocast_dtype": "bfloat16"}


def test_vllm_samples_in_the_runs_half_precision_and_bfloat16_for_a_float32_run(monkeypatch):
    import sys

    made = []
    fake = SimpleNamespace(VLLMGenerationBackend=lambda path, sampling, **kw: made.append(kw["dtype"]))
    monkeypatch.setitem(sys.modules, "stppo_agent.rollouts.vllm_generation", fake)
    for dtype in ("float16", "float32"):
        cfg = TrainConfig(model="m", env="stppo/Toy-v0", rollout=RolloutConfig(backend="vllm"),
                          precision=PrecisionConfig(dtype=dtype))
        model_setup.generation_backend(cfg, None, None, 0, None)
    assert made == ["float16", "bfloat16"]
