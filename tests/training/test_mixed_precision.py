"""autocast_dtype: forwards in bfloat16 with float32 weights, gradients, optimizer state and output heads."""

from __future__ import annotations

import inspect
import json
import platform
from pathlib import Path

import pytest
import torch

from stppo_agent.models.loading import load_actor, load_critic
from stppo_agent.models.precision import autocast_forward, resolve_autocast_dtype
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.config_sections import DistributedConfig, PrecisionConfig
from stppo_agent.training.trainer import Trainer
from tests.support.runs import toy_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer(), hidden=64)


def _output_dtypes(model, module: torch.nn.Module, **inputs) -> torch.dtype:
    seen = []
    handle = module.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    result = model(**inputs)
    handle.remove()
    return seen[0], result


def test_the_body_runs_in_bfloat16_and_the_heads_in_float32(tiny_model):
    actor = autocast_forward(load_actor(tiny_model), "bfloat16")
    ids = torch.tensor([[3, 4, 5, 6]])
    body_dtype, out = _output_dtypes(actor, actor.model.layers[0].self_attn.q_proj, input_ids=ids)
    assert body_dtype == torch.bfloat16
    assert out.logits.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in actor.parameters())
    critic = autocast_forward(load_critic(tiny_model), "bfloat16")
    body_dtype, values = _output_dtypes(critic, critic.model.layers[0].mlp.up_proj, input_ids=ids)
    assert body_dtype == torch.bfloat16 and values.logits.dtype == torch.float32


def test_without_autocast_nothing_changes(tiny_model):
    plain, wrapped = load_actor(tiny_model), autocast_forward(load_actor(tiny_model), None)
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.equal(plain(input_ids=ids).logits, wrapped(input_ids=ids).logits)


def test_the_wrapped_forward_keeps_the_signature_generate_reads(tiny_model):
    actor = autocast_forward(load_actor(tiny_model), "bfloat16")
    assert "logits_to_keep" in inspect.signature(actor.forward).parameters
    out = actor.generate(torch.tensor([[3, 4]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 5)


def test_gradients_are_float32_and_close_to_full_precision(tiny_model):
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 3, 4]])
    grads = {}
    for name in (None, "bfloat16"):
        actor = autocast_forward(load_actor(tiny_model), name)
        actor(input_ids=ids, labels=ids).loss.backward()
        grads[name] = torch.cat([p.grad.flatten() for p in actor.parameters()])
    assert grads["bfloat16"].dtype == torch.float32
    cosine = torch.nn.functional.cosine_similarity(grads[None], grads["bfloat16"], dim=0)
    assert cosine > 0.99, cosine


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="autocast_dtype must be bfloat16, auto"):
        TrainConfig(model="m", precision=PrecisionConfig(autocast_dtype="int8")).validate()
    with pytest.raises(ValueError, match="needs dtype=float32"):
        TrainConfig(model="m", precision=PrecisionConfig(autocast_dtype="bfloat16", dtype="bfloat16")).validate()
    with pytest.raises(ValueError, match="with fsdp2 use precision.fsdp_compute_dtype"):
        TrainConfig(model="m", precision=PrecisionConfig(autocast_dtype="bfloat16"),
                    distributed=DistributedConfig(strategy="fsdp2")).validate()


def test_a_run_under_autocast_learns_and_its_on_policy_ratios_stay_near_one(tiny_model, tmp_path):
    trainer = Trainer(toy_config(tiny_model, tmp_path, "ppo", iterations=6, precision=dict(autocast_dtype="bfloat16"),
                                 logging=dict(step_diagnostics=True)))
    trainer.train()
    assert all(p.dtype == torch.float32 for p in trainer.state.actor.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.state.actor_optimizer.state.values())
    records = read_metrics(tmp_path)
    assert records[-1]["reward"] > records[0]["reward"] + 0.2, [r["reward"] for r in records]
    # The first (on-policy) step's ratios are old log-probs over training log-probs of the same weights: under
    # autocast they differ only by bfloat16 noise across batch shapes, far inside the clip range.
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    first = [record for record in steps if record["on_policy"]]
    assert len(first) == 6
    assert all(abs(record["ratio_max"] - 1) < 0.05 and abs(record["ratio_min"] - 1) < 0.05 for record in first), first


@pytest.mark.parametrize("settings, name", [
    (dict(precision=dict(dtype="float16")), "precision.dtype"),
    (dict(precision=dict(autocast_dtype="float16")), "autocast_dtype"),
    (dict(distributed=dict(strategy="fsdp2"), precision=dict(fsdp_compute_dtype="float16")),
     "precision.fsdp_compute_dtype"),
])
def test_float16_training_is_refused_with_the_alternatives(settings, name):
    """No loss scaler exists, so float16 gradients would silently underflow: refused, naming what works."""
    with pytest.raises(ValueError, match=f"^{name}=float16 is refused for training: .*use bfloat16 .* or float32$"):
        TrainConfig(model="m", **settings).validate()


@pytest.mark.parametrize("settings", [dict(dtype="float16"), dict(autocast_dtype="float16")])
def test_sft_refuses_float16_before_any_work(settings, tmp_path):
    from stppo_agent.training.sft import SFTConfig, train_sft

    with pytest.raises(ValueError, match="float16 is refused for training"):  # before the model "m" is looked up
        train_sft(SFTConfig(model=str(tmp_path / "no-model"), output_dir=str(tmp_path / "out"), **settings))
    assert not (tmp_path / "out").exists()


def test_float16_weights_still_serve_evaluation(tiny_model):
    """No gradient is taken there, so float16 stays available to `hf:` agents."""
    from stppo_agent.evaluation.hf_agent import HFAgent

    agent = HFAgent(str(tiny_model), device="cpu", dtype="float16")
    assert next(agent.model.parameters()).dtype == torch.float16


def _mock_cpu(monkeypatch, flags):
    """A CPU with these /proc/cpuinfo flags, for both today's and torch's private probes."""
    from stppo_agent.models import precision as mixed_precision

    monkeypatch.setattr(mixed_precision, "cpu_flags", lambda: None if flags is None else set(flags), raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: "avx512_bf16" in (flags or ()))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: "amx_bf16" in (flags or ()))


@pytest.mark.parametrize("flags, expected", [
    # measured: bf16 autocast at 0.85x float32 on an AVX512-BF16 CPU without AMX -> float32 there
    ({"avx2", "avx512f", "avx512_bf16"}, None),
    ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "bfloat16"),
    ({"avx2"}, None),
    (set(), None),
])
def test_auto_picks_bfloat16_on_a_cpu_only_with_amx(monkeypatch, flags, expected):
    _mock_cpu(monkeypatch, flags)
    assert resolve_autocast_dtype("auto", torch.device("cpu")) == expected
    assert resolve_autocast_dtype("bfloat16", torch.device("cpu")) == "bfloat16"  # asked for: kept
    assert resolve_autocast_dtype(None, torch.device("cpu")) is None


def test_auto_without_proc_cpuinfo_asks_torch_for_amx(monkeypatch):
    from stppo_agent.models import precision as mixed_precision

    monkeypatch.setattr(mixed_precision, "cpu_flags", lambda: None)
    for amx, expected in ((True, "bfloat16"), (False, None)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert resolve_autocast_dtype("auto", torch.device("cpu")) == expected


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(), reason="x86 Linux")
def test_cpu_flags_are_this_machines():
    from stppo_agent.models.precision import cpu_flags

    assert {"fpu", "sse2"} <= cpu_flags()


def test_the_run_records_what_auto_chose(tiny_model, tmp_path, monkeypatch):
    _mock_cpu(monkeypatch, {"avx512_bf16"})
    trainer = Trainer(toy_config(tiny_model, tmp_path, "grpo", iterations=1, precision=dict(autocast_dtype="auto")))
    assert trainer.config.precision.autocast_dtype is None
    assert "autocast_dtype: null" in (tmp_path / "config.yaml").read_text()


def test_a_run_under_autocast_replays_exactly(tiny_model, tmp_path):
    """The stability study replays bfloat16-autocast recordings: same rule, same data -> the same update metrics."""
    from stppo_agent.training.replay import replay
    from tests.support.runs import TIMING

    run = tmp_path / "recorded"
    Trainer(toy_config(tiny_model, run, "ppo", iterations=2,
                       rollout=dict(prompts_per_iteration=4, samples_per_prompt=4),
                       optimizer=dict(mini_batch_size=4, micro_batch_size=2, epochs=2, actor_lr=2e-2),
                       logging=dict(save_rollouts=True), precision=dict(autocast_dtype="bfloat16"))).train()
    replay(run, None, str(tmp_path / "again"), report=lambda _: None)
    original, again = read_metrics(run), read_metrics(tmp_path / "again")
    assert len(original) == len(again) == 2
    for a, b in zip(original, again):
        for key in sorted(set(a) - TIMING):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert "autocast_dtype: bfloat16" in (tmp_path / "again" / "config.yaml").read_text()
