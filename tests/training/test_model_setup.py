"""``stppo_agent.training.model_setup``: the training state built from a model
folder or a checkpoint, dropout off, warm-up, sharding, and the settings each generation backend gets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import stppo_agent.training.model_setup as model_setup
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.config_sections import PrecisionConfig, RolloutConfig
from tests.support.training_parts import config, tiny_lm

# -- model_setup ------------------------------------------------------------------------------------------------

def test_disable_dropout_zeroes_every_dropout_module_and_config_rate():
    from stppo_agent.training.model_setup import disable_dropout

    model = torch.nn.Sequential(torch.nn.Dropout(0.3), torch.nn.Sequential(torch.nn.Dropout(0.1)))
    keys = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop")
    model.config = SimpleNamespace(**{key: 0.2 for key in keys}, classifier_dropout=0.4, name="x", layers=2)
    disable_dropout(model)
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == [0.0, 0.0]
    assert all(getattr(model.config, key) == 0.0 for key in keys)
    assert model.config.classifier_dropout == 0.4 and model.config.name == "x" and model.config.layers == 2
    bare = torch.nn.Linear(1, 1)
    bare.config = SimpleNamespace(dropout=None)
    disable_dropout(bare)
    assert bare.config.dropout is None  # not a rate: left alone


def test_warmup_is_linear_over_its_steps():
    from stppo_agent.training.model_setup import warmup

    assert [warmup(4)(step) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup(0)(0) == 1.0 and warmup(1)(0) == 1.0


def setup_models(monkeypatch, **values):
    """The config, the recorded call of build_state's loader (models built in memory, no folder) and the devices
    DDP wrapped for."""
    import stppo_agent.training.model_setup as model_setup
    from stppo_agent.models.loading import PolicyModels
    from stppo_agent.models.tiny import word_tokenizer

    calls = {}

    def load(actor_path, **kwargs):
        calls.update(actor_path=actor_path, **kwargs)
        actor = tiny_lm(0)
        actor.config.attention_dropout = 0.3
        critic = tiny_lm(1, critic=True) if kwargs["use_critic"] else None
        reference = tiny_lm(0).eval() if kwargs["need_reference"] else None
        for model in (actor, critic):
            if model is not None:
                model.eval()
                torch.nn.Module.add_module(model, "drop", torch.nn.Dropout(0.5))
        from stppo_agent.models.precision import autocast_forward

        return PolicyModels(autocast_forward(actor, kwargs["autocast_dtype"]), word_tokenizer(), critic, reference)

    wrapped = []
    monkeypatch.setattr(model_setup, "load_policy_models", load)
    monkeypatch.setattr(model_setup.process_group, "wrap_ddp", lambda model, device: wrapped.append(device) or model)
    return config(**values), calls, wrapped


def build(cfg, checkpoint=None, sharded=False):
    from stppo_agent.training.model_setup import build_state

    return build_state(cfg, cfg.algorithm_config(), torch.device("cpu"), sharded, checkpoint, report=print)


def test_build_state_loads_wraps_and_optimizes_each_model(monkeypatch):
    from stppo_agent.rollouts.hf_generation import HFGenerationBackend
    from stppo_agent.training.model_setup import generation_backend, weights_folder

    cfg, calls, wrapped = setup_models(monkeypatch, model="init", algo="ppo", critic_model="critic0",
                                       algorithm={"kl_loss_coef": 0.1, "kl_in_reward": 0.0},
                                       precision=dict(dtype="bfloat16"),
                                       optimizer=dict(gradient_checkpointing=True, actor_lr=0.01, critic_lr=0.02,
                                                      weight_decay=0.1, warmup_steps=4),
                                       rollout=dict(temperature=0.5, generation_batch_size=3, reuse_kv_cache=False))
    state = build(cfg)
    assert calls == dict(actor_path="init", critic_path="critic0", use_critic=True, need_reference=True,
                         dtype="bfloat16", gradient_checkpointing=True, reference_path="init", autocast_dtype=None)
    actor, critic = state.actor, state.critic
    assert state.reference is not None and len(state.tokenizer) == 9
    assert actor.training and critic.training
    assert actor.config.attention_dropout == 0.0 and actor.drop.p == 0.0 and critic.drop.p == 0.0
    assert state.actor_train is actor and state.critic_train is critic and wrapped == [torch.device("cpu")] * 2
    assert (state.iteration, state.optimizer_steps, state.nan_skips_total, state.actor_lr_scale) == (0, 0, 0, 1.0)
    assert state.sampler is None  # the rollout source, built later, holds the prompt position
    for optimizer, model, lr in ((state.actor_optimizer, actor, 0.01), (state.critic_optimizer, critic, 0.02)):
        assert isinstance(optimizer, torch.optim.AdamW)
        group = optimizer.param_groups[0]
        assert group["weight_decay"] == 0.1 and group["initial_lr"] == lr and group["lr"] == pytest.approx(lr / 4)
        assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]
    for optimizer, scheduler in ((state.actor_optimizer, state.actor_scheduler),
                                 (state.critic_optimizer, state.critic_scheduler)):
        optimizer.step()
        scheduler.step()
    assert state.actor_optimizer.param_groups[0]["lr"] == pytest.approx(0.005)
    assert state.critic_optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    assert state.stale_policy.staleness == 0 and state.stale_policy.model is actor
    assert weights_folder(cfg, None) is None
    backend = generation_backend(cfg, state.stale_policy.model, state.tokenizer, 0, None)
    assert isinstance(backend, HFGenerationBackend) and backend.model is actor
    assert backend.tokenizer is state.tokenizer
    assert backend.sampling.temperature == 0.5 and backend.batch_size == 3 and backend.reuse_cache is False


def test_build_state_on_resume_and_without_critic_or_reference(monkeypatch):
    from pathlib import Path

    from stppo_agent.training.model_setup import weights_folder

    cfg, calls, wrapped = setup_models(monkeypatch, model="init", algo="grpo",
                                       algorithm={"kl_loss_coef": 0.0, "kl_in_reward": 0.0},
                                       rollout=dict(samples_per_prompt=2, staleness=2),
                                       precision=dict(autocast_dtype="bfloat16"))
    state = build(cfg, Path("ckpt"))
    assert calls["actor_path"] == str(Path("ckpt") / "actor") and calls["critic_path"] == str(Path("ckpt") / "critic")
    assert calls["reference_path"] == "init" and calls["use_critic"] is False and calls["need_reference"] is False
    assert calls["autocast_dtype"] == "bfloat16"
    assert state.critic is None and state.reference is None and state.critic_train is None
    assert state.critic_optimizer is None and state.critic_scheduler is None and wrapped == [torch.device("cpu")]
    assert state.actor_optimizer.param_groups[0]["lr"] == 1e-6  # no warm-up
    assert state.stale_policy.staleness == 2 and state.stale_policy.model is not state.actor
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():  # the lagged copy computes under the run's autocast too
        assert torch.equal(state.stale_policy.model(input_ids=ids).logits, state.actor(input_ids=ids).logits)
    assert weights_folder(cfg, Path("ckpt")) == Path("ckpt")  # vLLM loads the resumed weights from there
    warm = config(init_from="runs/a/checkpoints/step-2")
    assert weights_folder(warm, None) == Path("runs/a/checkpoints/step-2")  # and a warm start's
    assert weights_folder(warm, Path("ckpt")) == Path("ckpt")  # a resume reads its own checkpoint, not init_from
    cfg, calls, _ = setup_models(monkeypatch, algo="ppo", algorithm={"kl_in_reward": 0.1, "kl_loss_coef": 0.0})
    build(cfg)
    assert calls["need_reference"] is True and calls["critic_path"] is None and calls["use_critic"] is True


def test_sharded_models_are_sharded_in_place_in_the_compute_dtype(monkeypatch):
    import stppo_agent.training.model_setup as model_setup

    sharded = []
    cfg, _, wrapped = setup_models(monkeypatch, algo="ppo", algorithm={"kl_loss_coef": 0.1},
                                   distributed=dict(strategy="fsdp2"), precision=dict(fsdp_compute_dtype="bfloat16"))
    monkeypatch.setattr(model_setup.process_group, "shard_fsdp2", lambda model, dtype: sharded.append((model, dtype)))
    state = build(cfg, sharded=True)
    assert [m for m, _ in sharded] == [state.actor, state.critic, state.reference] and not wrapped
    assert {d for _, d in sharded} == {torch.bfloat16}
    assert state.actor_train is state.actor and state.critic_train is state.critic
    sharded.clear()
    cfg, _, _ = setup_models(monkeypatch, algo="grpo", algorithm={"kl_loss_coef": 0.0},
                             distributed=dict(strategy="fsdp2"), rollout=dict(samples_per_prompt=2))
    state = build(cfg, sharded=True)
    assert sharded == [(state.actor, None)]


def test_the_vllm_backend_gets_the_run_settings(monkeypatch):
    import sys
    from pathlib import Path

    import stppo_agent.training.model_setup as model_setup

    made = []
    fake = SimpleNamespace(VLLMGenerationBackend=lambda path, sampling, **kw: made.append((path, sampling, kw)))
    monkeypatch.setitem(sys.modules, "stppo_agent.rollouts.vllm_generation", fake)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    cfg = config(seed=7, rollout=dict(backend="vllm", temperature=0.5, vllm_gpu_memory_utilization=0.6))
    model_setup.generation_backend(cfg, None, None, 0, None)
    import os

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    path, sampling, kw = made[0]
    assert path == "m" and sampling.temperature == 0.5
    assert kw == dict(dtype="bfloat16", seed=7, gpu_memory_utilization=0.6)
    cfg = config(seed=7, rollout=dict(backend="vllm"), precision=dict(dtype="bfloat16"))
    model_setup.generation_backend(cfg, None, None, 1, Path("ckpt"))
    from stppo_agent.distributed.process_group import rank_seed

    assert made[1][0] == str(Path("ckpt") / "actor") and made[1][2]["dtype"] == "bfloat16"
    assert made[1][2]["seed"] == rank_seed(7, 1) != 7
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    model_setup.generation_backend(cfg, None, None, 1, None)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # the user's own setting wins


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
