"""Pins of the trainer's units (issue 27, mutation testing): the config's validation and merging, the PPO update's
mini-batches / accumulation / clipping, response-token log-probs, the lagged policy, DAPO's resampling, the live
rollouts' prompts and seeds, the model setup and the SFT loss. Fast: no subprocess, tiny models or none."""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from stppo_agent.training.config import TrainConfig, _coerce, from_dict, load_config, merged

# -- config ---------------------------------------------------------------------------------------------------

def config(**values) -> TrainConfig:
    return from_dict(merged({"model": "m", "env": "stppo/Toy-v0"}, values))


def refused(message: str, **values) -> None:
    with pytest.raises(ValueError, match=message):
        config(**values).validate()


def test_config_defaults_are_the_documented_ones():
    c = TrainConfig()
    assert (c.algo, c.env, c.model, c.output_dir, c.iterations) == ("st_ppo", "stppo/NQ-v0", "", "runs/stppo", 100)
    assert (c.rollout.prompts_per_iteration, c.rollout.samples_per_prompt, c.optimizer.epochs,
            c.optimizer.mini_batch_size, c.optimizer.micro_batch_size,
            c.rollout.generation_batch_size) == (8, 1, 1, 8, 4, 64)
    assert (c.optimizer.actor_lr, c.optimizer.critic_lr, c.optimizer.warmup_steps, c.optimizer.weight_decay,
            c.optimizer.max_grad_norm) == (1e-6, 1e-5, 0, 0.0, 1.0)
    assert (c.rollout.temperature, c.rollout.top_p, c.rollout.top_k, c.rollout.staleness,
            c.rollout.stale_objective) == (1.0, 1.0, 0, 0, "coupled")
    assert (c.distributed.strategy, c.rollout.backend, c.precision.dtype, c.device, c.seed) == ("ddp", "hf",
                                                                                                "float32", "auto", 0)
    assert (c.checkpoint.every, c.checkpoint.keep, c.checkpoint.optimizer, c.monitor.max_nan_skips) == (10, 2, "all", 3)
    assert (c.monitor.max_search_error_rate, c.monitor.on_collapse, c.monitor.rollback_lr_factor,
            c.monitor.max_rollbacks) == (0.05, "warn", 0.5, 2)
    assert c.distributed.share_retriever and c.rollout.reuse_kv_cache and c.logging.tensorboard and c.logging.progress
    assert not (c.logging.save_rollouts or c.logging.step_diagnostics or c.optimizer.gradient_checkpointing)
    assert c.monitor.thresholds == {"kl_to_reference": 1.0} and c.algorithm == {} and c.plugins == []


def test_a_valid_config_passes():
    config().validate()
    config(distributed=dict(strategy="fsdp2"), precision=dict(fsdp_compute_dtype="bfloat16")).validate()
    config(precision=dict(autocast_dtype="bfloat16")).validate()
    config(rollout=dict(staleness=2, stale_objective="decoupled")).validate()
    config(rollout=dict(staleness=1)).validate()
    config(optimizer=dict(mini_batch_size=8, micro_batch_size=8)).validate()
    config(iterations=1, rollout=dict(prompts_per_iteration=1, generation_batch_size=1),
           optimizer=dict(epochs=1, mini_batch_size=1, micro_batch_size=1), checkpoint=dict(every=1, keep=1)).validate()
    config(rollout=dict(temperature=0.0)).validate()  # greedy
    config(monitor=dict(rollback_lr_factor=1.0, max_rollbacks=0)).validate()


def test_model_is_required():
    with pytest.raises(ValueError, match=r"^model is required: a Hugging Face folder or hub name \(--model\)$"):
        TrainConfig(env="stppo/Toy-v0").validate()


@pytest.mark.parametrize("name", ["iterations", "rollout.prompts_per_iteration", "rollout.samples_per_prompt",
                                  "optimizer.epochs", "optimizer.mini_batch_size", "optimizer.micro_batch_size",
                                  "rollout.generation_batch_size", "checkpoint.every", "checkpoint.keep"])
def test_counts_below_one_are_refused_by_name(name):
    refused(f"^{re.escape(name)} must be >= 1, got 0$", **{name: 0})


def test_mini_batches_must_be_whole_micro_batches():
    refused(r"optimizer.mini_batch_size \(6\) must be a multiple of optimizer.micro_batch_size \(4\)",
            optimizer=dict(mini_batch_size=6))


def test_strategy_and_fsdp_compute_dtype():
    refused(r"distributed.strategy must be ddp or fsdp2, got 'zero'", distributed=dict(strategy="zero"))
    refused(r"^precision.fsdp_compute_dtype needs distributed.strategy=fsdp2 \(DDP computes in precision.dtype\)$",
            precision=dict(fsdp_compute_dtype="bfloat16"))
    refused(r"precision.fsdp_compute_dtype must be bfloat16 or float16, got 'float32'",
            distributed=dict(strategy="fsdp2"), precision=dict(fsdp_compute_dtype="float32"))
    refused(r"^precision.fsdp_compute_dtype=float16 is refused for training", distributed=dict(strategy="fsdp2"),
            precision=dict(fsdp_compute_dtype="float16"))
    refused(r"^precision.dtype=float16 is refused for training", precision=dict(dtype="float16"))


def test_autocast_settings():
    refused(r"^precision.autocast_dtype is for distributed.strategy=ddp; with fsdp2 use precision.fsdp_compute_dtype "
            r"\(FSDP2's own mixed precision\)$",
            distributed=dict(strategy="fsdp2"), precision=dict(autocast_dtype="bfloat16"))
    refused(r"^autocast_dtype must be", precision=dict(autocast_dtype="int8"))
    refused(r"autocast_dtype=bfloat16 needs dtype=float32",
            precision=dict(autocast_dtype="bfloat16", dtype="bfloat16"))


def test_sampling_backend_and_env_are_checked_before_loading():
    refused("temperature must be > 0", rollout=dict(temperature=-1.0))
    refused("top_p", rollout=dict(top_p=0.0))
    refused(r"rollout.backend must be hf or vllm, got 'sglang'", rollout=dict(backend="sglang"))
    with pytest.raises(Exception, match="NoSuch"):
        config(env="stppo/Toy-v0, stppo/NoSuch-v0").validate()
    config(env=" stppo/Toy-v0 ,").validate()  # blanks and empty items are skipped


def test_collapse_checkpoint_and_rollout_limit_settings():
    refused(r"monitor.on_collapse must be one of none, warn, stop, rollback, got 'panic'",
            monitor=dict(on_collapse="panic"))
    refused(r"monitor.warmup", monitor=dict(warmup=1))
    refused(r"monitor.rollback_lr_factor must be in \(0, 1\], got 0.0", monitor=dict(rollback_lr_factor=0.0))
    refused(r"monitor.rollback_lr_factor must be in \(0, 1\], got 1.5", monitor=dict(rollback_lr_factor=1.5))
    refused(r"monitor.max_rollbacks must be >= 0, got -1", monitor=dict(max_rollbacks=-1))
    refused(r"checkpoint.dtype must be", checkpoint=dict(dtype="int8"))
    refused(r"checkpoint.optimizer must be", checkpoint=dict(optimizer="some"))
    refused(r"checkpoint.optimizer=newest drops", checkpoint=dict(optimizer="newest"),
            monitor=dict(on_collapse="rollback"))
    config(checkpoint=dict(optimizer="newest"), monitor=dict(on_collapse="stop")).validate()
    refused(r"max_total_tokens \(10\) must fit",
            rollout=dict(max_prompt_tokens=8, max_new_tokens_per_turn=4, max_total_tokens=10))
    refused(r"rollout limit max_turns must be >= 1", rollout=dict(max_turns=0))


def test_group_advantages_need_groups_of_two():
    refused(r"algorithm grpo uses group-relative advantages \(grpo\): a group of one", algo="grpo")
    config(algo="grpo", rollout=dict(samples_per_prompt=2)).validate()
    config(algo="ppo", rollout=dict(samples_per_prompt=1)).validate()


def test_staleness_settings():
    refused(r"^rollout.staleness must be >= 0, got -1$", rollout=dict(staleness=-1))
    refused(r"^rollout.stale_objective must be coupled or decoupled, got 'mixed'$",
            rollout=dict(stale_objective="mixed"))
    config(rollout=dict(staleness=0),
           distributed=dict(strategy="fsdp2")).validate()  # K = 0: nothing lags, any strategy
    config(algorithm={"rollout_correction": "none"}, rollout=dict(staleness=0, stale_objective="decoupled")).validate()
    refused(r"^rollout.staleness > 0 needs distributed.strategy=ddp and rollout.backend=hf \(the lagged copy of the "
            r"weights is a whole module; sharded and vLLM copies are not implemented\)$", rollout=dict(staleness=1),
            distributed=dict(strategy="fsdp2"))
    refused(r"^rollout.staleness > 0 needs distributed.strategy=ddp and rollout.backend=hf",
            rollout=dict(staleness=1, backend="vllm"))
    refused(r"^rollout.stale_objective=decoupled weights each token by pi_prox / pi_behav: set "
            r"algorithm.rollout_correction to mis, tis or auto \(auto picks mis\), not none$",
            algorithm={"rollout_correction": "none"},
            rollout=dict(staleness=1, stale_objective="decoupled"))
    config(algorithm={"rollout_correction": "none"}, rollout=dict(staleness=1, stale_objective="coupled")).validate()
    config(algorithm={"rollout_correction": "tis"}, rollout=dict(staleness=1, stale_objective="decoupled")).validate()


def test_algorithm_config_merges_the_preset_the_overrides_and_the_backend():
    algo = config(algo="grpo", algorithm={"clip_high": 1}).algorithm_config()
    assert algo.advantage == "grpo" and algo.clip_high == 1.0 and isinstance(algo.clip_high, float)
    assert algo.rollout_correction == "none" and algo.rollout_correction_level == "token"
    assert config(rollout=dict(backend="vllm")).algorithm_config().rollout_correction == "tis"
    # decoupled PPO needs the behaviour weight: auto -> mis, but only with a lag and that objective
    assert config(rollout=dict(staleness=1, stale_objective="decoupled")).algorithm_config().rollout_correction == "mis"
    assert config(rollout=dict(staleness=0,
                               stale_objective="decoupled")).algorithm_config().rollout_correction == "none"
    assert config(rollout=dict(staleness=1, stale_objective="coupled")).algorithm_config().rollout_correction == "none"
    tis = config(algorithm={"rollout_correction": "tis"}, rollout=dict(staleness=1, stale_objective="decoupled"))
    assert tis.algorithm_config().rollout_correction == "tis"
    with pytest.raises(ValueError, match=r"^unknown algorithm fields \['clip_hihg'\] \(did you mean clip_high\?\)"):
        config(algorithm={"clip_hihg": 0.3}).algorithm_config()
    with pytest.raises(ValueError, match=r"config field algorithm.clip_high expects float, got 'x'"):
        config(algorithm={"clip_high": "x"}).algorithm_config()


def test_plugins_are_loaded_before_the_preset_is_looked_up(tmp_path, monkeypatch):
    (tmp_path / "pins_training_algo.py").write_text(
        "import dataclasses\nfrom stppo_agent.algorithms import ALGORITHMS, register_algorithm\n"
        "register_algorithm(dataclasses.replace(ALGORITHMS['ppo'], name='pins_training_algo', clip_high=0.4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    c = config(algo="pins_training_algo", plugins=["pins_training_algo"])
    assert c.algorithm_config().clip_high == 0.4
    c.validate()


def test_rollout_limits_and_sampling_come_from_the_flat_fields():
    c = config(rollout=dict(max_turns=3, max_new_tokens_per_turn=5, max_observation_tokens=7, max_prompt_tokens=11,
                            max_total_tokens=99, temperature=0.7, top_p=0.9, top_k=5))
    limits = c.rollout_limits()
    assert (limits.max_turns, limits.max_new_tokens_per_turn, limits.max_observation_tokens,
            limits.max_prompt_tokens, limits.max_total_tokens) == (3, 5, 7, 11, 99)
    s = c.sampling()
    assert (s.temperature, s.top_p, s.top_k, s.greedy) == (0.7, 0.9, 5, False)
    assert config(rollout=dict(temperature=0.0)).sampling().greedy is True


def test_to_yaml_holds_the_overrides_or_every_resolved_field():
    c = config(algorithm={"clip_high": 0.3}, seed=5)
    plain = yaml.safe_load(c.to_yaml())
    assert plain["algorithm"] == {"clip_high": 0.3} and plain["seed"] == 5 and plain["model"] == "m"
    assert list(plain)[:4] == ["algo", "algorithm", "algorithm_resolved", "plugins"]  # field order kept
    resolved = c.algorithm_config()
    full = yaml.safe_load(c.to_yaml(resolved))
    assert "name" not in full["algorithm"] and full["algorithm"]["clip_high"] == 0.3
    assert full["algorithm"]["advantage"] == resolved.advantage and len(full["algorithm"]) >= 15
    # what the user left to auto stays auto, beside what it resolved to
    assert full["algorithm"]["rollout_correction"] == full["algorithm"]["rollout_correction_level"] == "auto"
    assert full["algorithm_resolved"] == {"rollout_correction": "none", "rollout_correction_level": "turn"}


def test_load_config_layers_file_flags_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 3\noptimizer:\n  actor_lr: 1\nmodel: from_file\nalgorithm:\n  clip_high: 0.25\n")
    c = load_config(path, ["seed=9", "algorithm.clip_low=0.1"], model="flag", output_dir=None)
    assert c.seed == 9 and c.optimizer.actor_lr == 1.0 and isinstance(c.optimizer.actor_lr, float)
    assert c.model == "flag" and c.output_dir == "runs/stppo"  # a None flag does not override
    assert c.algorithm == {"clip_high": 0.25, "clip_low": 0.1}
    assert load_config(None, None).model == "" and load_config().seed == 0
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty).algo == "st_ppo"
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"list.yaml: a config file must hold a mapping of field: value"):
        load_config(listed)
    broken = tmp_path / "broken.yaml"
    broken.write_text("seed: [1\n")
    with pytest.raises(ValueError, match=r"broken.yaml is not valid YAML: "):
        load_config(broken)
    resolved = dict(yaml.safe_load(config(algo="ppo").to_yaml(config(algo="ppo").algorithm_config()))["algorithm"])
    assert load_config(None, [], algorithm=resolved).algorithm == resolved  # no file: nothing to drop
    with pytest.raises(ValueError, match=r"^--set expects key=value, got 'seed'$"):
        load_config(None, ["seed"])
    with pytest.raises(ValueError, match=r"^--set seed=\[1: the value is not valid YAML"):
        load_config(None, ["seed=[1"])
    assert load_config(None, ["env=a=b"]).env == "a=b"  # only the first = splits


def test_sectioned_overrides_keep_the_section_defaults():
    c = load_config(None, ["monitor.thresholds.entropy=0.5"])
    assert c.monitor.thresholds == {"kl_to_reference": 1.0, "entropy": 0.5}
    c = load_config(None, ["env_kwargs.topk=3", "env_kwargs.split=dev"])
    assert c.env_kwargs == {"topk": 3, "split": "dev"}
    c = load_config(None, ["algorithm.clip_high=0.3", "algorithm.clip_high=0.35"])
    assert c.algorithm == {"clip_high": 0.35}
    assert TrainConfig().monitor.thresholds is not TrainConfig().monitor.thresholds
    assert load_config(None, ["env_kwargs.a.b=1"]).env_kwargs == {"a.b": 1}  # the first dot splits
    c = load_config(None, ["monitor.thresholds.kl_to_reference=2"])
    assert TrainConfig().monitor.thresholds == {"kl_to_reference": 1.0} and c.monitor.thresholds[
        "kl_to_reference"] == 2


def test_a_run_config_under_another_algo_drops_the_old_resolved_fields(tmp_path):
    resolved = config(algo="ppo").algorithm_config()
    run = tmp_path / "run.yaml"
    run.write_text(config(algo="ppo").to_yaml(resolved))
    assert load_config(run, [], algo="grpo").algorithm == {}
    assert load_config(run, []).algorithm["advantage"] == "gae"  # the same algo: kept
    assert load_config(run, [], algo="ppo").algorithm["advantage"] == "gae"
    partial = tmp_path / "partial.yaml"
    partial.write_text("algo: ppo\nalgorithm:\n  clip_high: 0.3\n")
    assert load_config(partial, [], algo="grpo").algorithm == {"clip_high": 0.3}  # hand-written: kept
    no_algo = tmp_path / "no_algo.yaml"
    no_algo.write_text(yaml.safe_dump({"algorithm": dict(yaml.safe_load(run.read_text())["algorithm"])}))
    assert load_config(no_algo, [], algo="grpo").algorithm["advantage"] == "gae"  # no algo in the file: kept


def test_from_dict_and_unknown_field_messages():
    assert from_dict({"seed": 4, "optimizer": {"actor_lr": 2}}).optimizer.actor_lr == 2.0
    with pytest.raises(ValueError, match=r"^config field seed expects int, got 'x'$"):
        from_dict({"seed": "x"})
    with pytest.raises(ValueError, match=r"^unknown key 'actor_lrr'; did you mean 'optimizer.actor_lr'\? \(stppo train "
                                         r"--help lists every key\)$"):
        from_dict({"actor_lrr": 1})
    with pytest.raises(ValueError, match=r"^unknown key 'sed'; did you mean 'seed'\?"):
        from_dict({"sed": 1})
    with pytest.raises(ValueError,
                       match=r"^unknown key 'rollout.zzzzzz'; section rollout holds prompts_per_iteration, "):
        from_dict({"rollout": {"zzzzzz": 1}})
    with pytest.raises(ValueError, match=r"^unknown key 'zzzzzz' \(stppo train --help"):
        from_dict({"zzzzzz": 1})


@pytest.mark.parametrize("value, hint, expected", [
    (1, float, 1.0), (1, float | None, 1.0), (None, int, None), ({"a": 1}, dict, {"a": 1}),
    ({"a": 1}, dict[str, int] | None, {"a": 1}), ("x", typing.Any, "x"),
    (True, bool, True), (3, int, 3), ("s", str, "s"), ("s", str | None, "s"), ("mod", list, ["mod"]),
    (["a", "b"], list | None, ["a", "b"]), (["a"], list, ["a"])])
def test_coerce_converts_or_keeps(value, hint, expected):
    out = _coerce("k", value, hint)
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize("value, hint, name", [(True, float, "float"), (True, int, "int"), (1, bool, "bool"),
                                               (1.5, int, "int"), (1, str, "str"), ("1", float, "float"),
                                               (3, list, "list")])
def test_coerce_refuses_the_wrong_type_by_name(value, hint, name):
    with pytest.raises(ValueError, match=rf"^config field k expects {name}, got {value!r}$"):
        _coerce("k", value, hint)


# -- tiny in-memory models and batches -------------------------------------------------------------------------

VOCAB = 12


def tiny_lm(seed: int = 0, critic: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=None, eos_token_id=1, num_labels=1)
    model = (LlamaForTokenClassification if critic else LlamaForCausalLM)(cfg)
    for module in model.modules():  # the value head's dropout: scores must repeat (as disable_dropout does)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


class NoKeep(torch.nn.Module):
    """A causal LM whose forward has no ``logits_to_keep`` (the slicing path of response_logits)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, use_cache=False, **kwargs):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, **kwargs)

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()


# (prompt, [(ids, policy, turn), ...]) of different lengths: left padding, masked observations, several turns
EPISODES = [([3, 4], [([5, 6], True, 0), ([7], False, -1), ([8, 9], True, 1)]),
            ([3, 4, 5, 6], [([9], True, 0)]),
            ([7], [([4, 4, 4], True, 0), ([5, 5], False, -1), ([6], True, 1)]),
            ([3, 8, 8], [([10, 11], True, 0)]),
            ([5, 5], [([3], True, 0), ([2, 2, 2], False, -1)]),
            ([6], [([7, 7], True, 0)])]


def make_batch(episodes=EPISODES, seed: int = 0):
    from stppo_agent.rollouts.batch import Trajectory, to_batch

    trajectories = []
    for number, (prompt, pieces) in enumerate(episodes):
        t = Trajectory(env=None, group_id=number // 2, prompt_ids=list(prompt), reward=float(number % 2))
        for ids, policy, turn in pieces:
            t.append(ids, policy=policy, turn=turn)
        trajectories.append(t)
    batch = to_batch(trajectories, pad_id=0)
    g = torch.Generator().manual_seed(seed)
    shape = batch.response_ids.shape
    batch.old_logprobs = -1.5 + 0.3 * torch.randn(shape, generator=g)
    batch.ref_logprobs = -1.5 + 0.3 * torch.randn(shape, generator=g)
    batch.advantages = torch.randn(shape, generator=g)
    batch.values = torch.randn(shape, generator=g)
    batch.returns = torch.randn(shape, generator=g)
    return batch


def row_logits(model, prompt, response):
    """Logits predicting each response token, from an unpadded forward of one trajectory."""
    ids = torch.tensor([list(prompt) + list(response)])
    return model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(response)]


# -- log_probs ------------------------------------------------------------------------------------------------

def test_position_ids_skip_left_padding():
    from stppo_agent.training.log_probs import position_ids

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 0, 0, 0, 1]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3], [0, 0, 0, 0, 0]]


@pytest.mark.parametrize("keep", [True, False])
def test_response_logits_and_logprobs_are_those_of_each_unpadded_trajectory(keep):
    from stppo_agent.training.log_probs import accepts_logits_to_keep, response_logits, token_logprobs

    model = tiny_lm().eval()
    scored = model if keep else NoKeep(model)
    assert accepts_logits_to_keep(scored) is keep
    batch = make_batch()
    with torch.no_grad():
        logits = response_logits(scored, batch)
        logprobs, entropy = token_logprobs(scored, batch, with_entropy=True)
        for row, (prompt, pieces) in enumerate(EPISODES):
            response = [i for ids, _, _ in pieces for i in ids]
            n = len(response)
            expected = row_logits(model, prompt, response)
            assert torch.allclose(logits[row, :n], expected, atol=1e-5), row
            log_softmax = torch.log_softmax(expected, -1)
            chosen = log_softmax.gather(-1, torch.tensor(response)[:, None])[:, 0]
            assert torch.allclose(logprobs[row, :n], chosen, atol=1e-5), row
            mask = batch.loss_mask[row, :n]
            want = -(log_softmax.exp() * log_softmax).sum(-1)
            assert torch.allclose(entropy[row, :n][mask], want[mask], atol=1e-5), row
            assert (entropy[row][~batch.loss_mask[row]] == 0).all()
    assert logprobs.dtype == torch.float32 and logprobs.shape == batch.response_ids.shape


@pytest.mark.parametrize("keep", [True, False])
def test_the_forward_gets_the_mask_positions_and_no_cache(keep):
    """What the model is handed (transformers 5 infers a mask from position ids, so logits alone would not tell)."""
    from stppo_agent.training.log_probs import position_ids, response_logits

    seen = {}
    inner = tiny_lm().eval()

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, **kwargs):
            seen.update(kwargs, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache)
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)

    class RecorderKeep(Recorder):
        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, logits_to_keep=0):
            return super().forward(input_ids, attention_mask, position_ids, use_cache, logits_to_keep=logits_to_keep)

    batch = make_batch()
    with torch.no_grad():
        logits = response_logits(RecorderKeep() if keep else Recorder(), batch)
    assert logits.shape[:2] == batch.response_ids.shape
    assert seen["attention_mask"] is batch.attention_mask and seen["use_cache"] is False
    assert torch.equal(seen["position_ids"], position_ids(batch.attention_mask))
    assert seen.get("logits_to_keep", None) == (batch.response_ids.shape[1] + 1 if keep else None)


def test_token_logprobs_score_under_the_sampling_temperature_and_truncation():
    from stppo_agent.rollouts.sampling import SamplingSettings
    from stppo_agent.training.log_probs import token_logprobs

    model = tiny_lm().eval()
    batch = make_batch()
    with torch.no_grad():
        plain, none = token_logprobs(model, batch)
        assert none is None
        hot, _ = token_logprobs(model, batch, sampling=SamplingSettings(temperature=2.0))
        prompt, pieces = EPISODES[0]
        response = [i for ids, _, _ in pieces for i in ids]
        logits = row_logits(model, prompt, response) / 2.0
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert torch.allclose(hot[0, :len(response)], want, atol=1e-5)
        assert not torch.allclose(hot, plain)
        truncated, _ = token_logprobs(model, batch, sampling=SamplingSettings(top_k=2))
        observed = ~batch.loss_mask & batch.attention_mask[:, batch.prompt_width:].bool()
        assert observed.any()  # tokens the policy did not act on are scored untruncated (their log-probs go unused)
        assert torch.allclose(truncated[observed], plain[observed], atol=1e-6)
        assert not torch.allclose(truncated[batch.loss_mask], plain[batch.loss_mask])
        _, entropy = token_logprobs(model, batch, with_entropy=True, sampling=SamplingSettings(top_k=3))
        assert torch.isfinite(entropy).all() and (entropy[batch.loss_mask] > 0).all()
        assert (entropy[batch.loss_mask] <= math.log(4) + 1e-5).all()  # support: 3 tokens and the sampled one


def test_the_entropy_carries_a_gradient_only_when_asked():
    from stppo_agent.training.log_probs import token_logprobs

    model = tiny_lm()
    batch = make_batch()
    logprobs, entropy = token_logprobs(model, batch, with_entropy=True)
    assert logprobs.requires_grad and not entropy.requires_grad
    _, entropy = token_logprobs(model, batch, with_entropy=True, entropy_grad=True)
    assert entropy.requires_grad
    with torch.no_grad():
        _, entropy = token_logprobs(model, batch, with_entropy=True, entropy_grad=True)
    assert not entropy.requires_grad


def test_critic_values_are_the_value_head_before_each_response_token():
    from stppo_agent.training.log_probs import critic_values

    critic = tiny_lm(1, critic=True).eval()
    batch = make_batch()
    with torch.no_grad():
        values = critic_values(critic, batch)
        assert values.shape == batch.response_ids.shape and values.dtype == torch.float32
        for row, (prompt, pieces) in enumerate(EPISODES):
            response = [i for ids, _, _ in pieces for i in ids]
            ids = torch.tensor([list(prompt) + response])
            want = critic(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(response), 0]
            assert torch.allclose(values[row, :len(response)], want, atol=1e-5), row


def test_the_critic_gets_the_mask_and_positions():
    from stppo_agent.training.log_probs import critic_values, position_ids

    seen = {}
    inner = tiny_lm(1, critic=True).eval()

    def critic(input_ids, attention_mask=None, position_ids=None):
        seen.update(attention_mask=attention_mask, position_ids=position_ids)
        return inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    batch = make_batch()
    with torch.no_grad():
        critic_values(critic, batch)
    assert seen["attention_mask"] is batch.attention_mask
    assert torch.equal(seen["position_ids"], position_ids(batch.attention_mask))


def test_length_sorted_micro_batches_cover_every_row_shortest_first():
    from stppo_agent.training.log_probs import length_sorted_micro_batches

    batch = make_batch()
    parts = list(length_sorted_micro_batches(batch, 4))
    assert [len(rows) for rows, _ in parts] == [4, 2]
    rows = torch.cat([r for r, _ in parts])
    lengths = batch.lengths()
    assert sorted(rows.tolist()) == list(range(6))
    assert lengths[rows].tolist() == sorted(lengths.tolist())
    assert rows.tolist() == torch.argsort(lengths, stable=True).tolist()
    first = parts[0][1]
    assert first.response_ids.shape[1] < batch.response_ids.shape[1]  # trimmed to its own longest
    assert first.response_ids.tolist() == batch.select(parts[0][0]).trimmed().response_ids.tolist()
    assert [len(r) for r, _ in length_sorted_micro_batches(batch, 1)] == [1] * 6


@pytest.mark.parametrize("training", [True, False])
def test_batched_no_grad_keeps_row_order_width_and_the_training_flag(training):
    from stppo_agent.training.log_probs import batched_no_grad, token_logprobs

    model = tiny_lm()
    model.train(training)
    batch = make_batch()
    out = batched_no_grad(token_logprobs, model, batch, 2)
    assert model.training is training and not out.requires_grad
    assert out.shape == batch.response_ids.shape
    with torch.no_grad():
        model.eval()
        whole, _ = token_logprobs(model, batch)
    mask = batch.attention_mask[:, batch.prompt_width:].bool()
    assert torch.allclose(out[mask], whole[mask], atol=1e-5)
    from stppo_agent.training.log_probs import length_sorted_micro_batches

    for rows, micro in length_sorted_micro_batches(batch, 2):
        assert (out[rows, micro.response_ids.shape[1]:] == 0).all()
    assert (out[:, -1] == 0).sum() == 4  # only the two longest rows reach the last column


# -- ppo_update -----------------------------------------------------------------------------------------------

class Said(list):
    """What a stage said through its report or phase callback, in order."""

    def __call__(self, text: str) -> None:
        self.append(text)


def update_stage(algo: str = "ppo", critic: bool = True, lr: float = 0.1, **values):
    """The update stage over a real training state of tiny models with SGD optimizers at constant rates; its
    ``report`` and ``phase`` are :class:`Said` lists."""
    from pathlib import Path

    from stppo_agent.training.ppo_update import PPOUpdate
    from stppo_agent.training.stale_policy import StalePolicy
    from stppo_agent.training.state import TrainingState

    values = merged({"rollout": {"temperature": 0.7},
                     "optimizer": {"micro_batch_size": 2, "mini_batch_size": 4, "max_grad_norm": 1e6}}, values)
    cfg = config(algo=algo, **values)
    actor = tiny_lm(0)
    value_model = tiny_lm(1, critic=True) if critic else None
    actor_optimizer = torch.optim.SGD(actor.parameters(), lr=lr)
    critic_optimizer = torch.optim.SGD(value_model.parameters(), lr=lr) if critic else None
    state = TrainingState(
        tokenizer=None, actor=actor, actor_optimizer=actor_optimizer,
        actor_scheduler=torch.optim.lr_scheduler.LambdaLR(actor_optimizer, lambda step: 1.0),
        stale_policy=StalePolicy(actor, 0), critic=value_model, critic_optimizer=critic_optimizer,
        critic_scheduler=torch.optim.lr_scheduler.LambdaLR(critic_optimizer, lambda step: 1.0) if critic else None)
    return PPOUpdate(state, cfg, cfg.algorithm_config(), run_dir=Path("runs/pins"), report=Said(), phase=Said())


def reference_actor_grads(t, mini):
    """The gradient of the policy loss over the whole mini-batch in one forward (no accumulation)."""
    from stppo_agent.algorithms import get_policy_loss
    from stppo_agent.training.log_probs import token_logprobs

    t.state.actor.zero_grad(set_to_none=True)
    logprobs, entropy = token_logprobs(t.state.actor, mini, with_entropy=True, entropy_grad=t.algo.entropy_coef > 0,
                                       sampling=t.config.sampling())
    loss, _, metrics = get_policy_loss(t.algo.policy_loss)(
        logprobs=logprobs, old_logprobs=mini.old_logprobs, advantages=mini.advantages, loss_mask=mini.loss_mask,
        turn_ids=mini.turn_ids, config=t.algo, ref_logprobs=mini.ref_logprobs if t.algo.kl_loss_coef > 0 else None,
        entropy=entropy, global_num_tokens=mini.loss_mask.sum().float(),
        global_num_seqs=mini.loss_mask.any(1).sum().float())
    loss.backward()
    grads = [p.grad.clone() for p in t.state.actor.parameters()]
    t.state.actor.zero_grad(set_to_none=True)
    return grads, metrics


@pytest.mark.parametrize("algo, algorithm", [
    ("ppo", {"kl_loss_coef": 0.3, "entropy_coef": 0.05, "clip_low": 0.05, "clip_high": 0.05}),
    ("grpo", {"kl_loss_coef": 0.0, "loss_agg": "seq-mean-token-mean"}),
    ("gspo", {})])
def test_accumulated_micro_batch_gradients_are_the_whole_mini_batch_gradient(algo, algorithm):

    t = update_stage(algo, algorithm=algorithm, optimizer=dict(micro_batch_size=1))
    mini = make_batch().select([0, 2, 3, 4])
    want, metrics = reference_actor_grads(t, mini)
    out = t.actor_gradients(mini)
    got = [p.grad for p in t.state.actor.parameters()]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6, rtol=1e-4)
    norm = torch.sqrt(sum((w ** 2).sum() for w in want))
    assert out["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    assert out["pg_loss"] == pytest.approx(float(metrics["pg_loss"]), rel=1e-4, abs=1e-6)


def test_gradients_are_clipped_to_max_grad_norm_and_the_norm_before_is_reported():

    t = update_stage(optimizer=dict(max_grad_norm=1e-3))
    mini = make_batch().select([0, 1, 2, 3])
    want, _ = reference_actor_grads(t, mini)
    out = t.actor_gradients(mini)
    norm = float(torch.sqrt(sum((w ** 2).sum() for w in want)))
    assert norm > 0.01 and out["grad_norm"] == pytest.approx(norm, rel=1e-4)
    after = float(torch.sqrt(sum((p.grad ** 2).sum() for p in t.state.actor.parameters())))
    assert after == pytest.approx(1e-3, rel=1e-3)


def test_a_clip_bias_corrected_step_is_the_same_whatever_the_micro_batch_size():

    mini = make_batch().select([0, 1, 2, 3])
    grads, outs = [], []
    for micro in (1, 4):
        t = update_stage("st_ppo", optimizer=dict(micro_batch_size=micro, mini_batch_size=4))
        assert t.algo.clip_bias_correction
        outs.append(t.actor_gradients(mini))
        grads.append([p.grad.clone() for p in t.state.actor.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert outs[0]["grad_norm"] == pytest.approx(outs[1]["grad_norm"], rel=1e-4)
    corrector_keys = {k for k in outs[0] if k not in ("grad_norm", "learner_kl_to_reference")} - set(
        reference_actor_grads(update_stage("st_ppo"), mini)[1])
    assert corrector_keys and all(outs[0][k] == pytest.approx(outs[1][k], rel=1e-4, abs=1e-7)
                                  for k in corrector_keys)
    measured = update_stage("ppo", logging=dict(step_diagnostics=True)).actor_gradients(mini)
    assert {"clip_bias_norm", "pg_grad_norm"} <= corrector_keys
    # with step diagnostics ||C|| is measured for every algorithm, but only S-PPO / ST-PPO rescale by it
    assert {"clip_bias_norm", "pg_grad_norm"} <= set(measured) and "clip_bias_scale" not in measured
    assert not corrector_keys & set(update_stage("ppo").actor_gradients(mini))


def test_the_critic_step_fits_the_returns_from_the_old_values():
    from stppo_agent.algorithms import value_loss
    from stppo_agent.training.log_probs import critic_values

    t = update_stage(optimizer=dict(micro_batch_size=1))
    mini = make_batch().select([0, 2, 3, 5])
    loss, metrics = value_loss(values=critic_values(t.state.critic, mini), old_values=mini.values, returns=mini.returns,
                               loss_mask=mini.loss_mask, config=t.algo, global_num_tokens=mini.loss_mask.sum().float())
    loss.backward()
    want = [p.grad.clone() for p in t.state.critic.parameters()]
    before = [p.detach().clone() for p in t.state.critic.parameters()]
    out = t._critic_step(mini)
    norm = float(torch.sqrt(sum((w ** 2).sum() for w in want)))
    assert out["critic_grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert out["value_loss"] == pytest.approx(float(metrics["value_loss"]), rel=1e-4)
    for p, b, w in zip(t.state.critic.parameters(), before, want):  # one SGD step of lr 0.1 on that gradient
        assert torch.allclose(p.detach(), b - 0.1 * w, atol=1e-6)


def test_the_critic_gradient_is_clipped():

    t = update_stage(optimizer=dict(max_grad_norm=1e-4))
    before = [p.detach().clone() for p in t.state.critic.parameters()]
    out = t._critic_step(make_batch().select([0, 1, 2, 3]))
    assert out["critic_grad_norm"] > 1e-3
    moved = math.sqrt(sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(t.state.critic.parameters(), before)))
    assert moved == pytest.approx(0.1 * 1e-4, rel=1e-3)


def test_an_update_steps_epochs_times_mini_batches_in_a_seeded_order():

    t = update_stage(seed=3, optimizer=dict(epochs=2, mini_batch_size=4, micro_batch_size=2))
    t.state.iteration = 2
    batch = make_batch()
    batch.group_ids = torch.arange(6)
    updater, seen = t, []
    step = updater._optimizer_step
    updater._optimizer_step = lambda mini: seen.append(mini.group_ids.tolist()) or step(mini)
    before = [p.detach().clone() for p in t.state.actor.parameters()]
    metrics = updater.update(batch)
    g = torch.Generator().manual_seed(3 + 2)
    orders = [torch.randperm(6, generator=g).tolist() for _ in range(2)]
    assert seen == [orders[0][:4], orders[0][4:], orders[1][:4], orders[1][4:]]
    assert t.state.optimizer_steps == 4 and t.phase == [f"update step {i}/4" for i in range(1, 5)]
    assert metrics["offpolicy/steps"] == 3.0  # every step after the first
    assert metrics["nan_skips_total"] == 0 and metrics["actor_lr"] == 0.1
    assert metrics["update_tokens_per_s"] > 0
    assert "value_loss" in metrics and "pg_loss" in metrics and "critic_grad_norm" in metrics
    assert any(not torch.equal(p.detach(), b) for p, b in zip(t.state.actor.parameters(), before))


def test_update_counts_the_policy_tokens_it_trained_on(monkeypatch):
    import stppo_agent.training.ppo_update as ppo_update

    t = update_stage(optimizer=dict(epochs=3, mini_batch_size=6, micro_batch_size=6))
    batch = make_batch()
    clock = iter([5.0, 5.5])  # half a second (a lower bound of one second on the time would show)
    monkeypatch.setattr(ppo_update.time, "perf_counter", lambda: next(clock))
    metrics = t.update(batch)
    assert metrics["update_tokens_per_s"] == pytest.approx(3 * int(batch.loss_mask.sum()) / 0.5)
    monkeypatch.undo()
    one_epoch = update_stage(critic=False, optimizer=dict(epochs=1, mini_batch_size=4, micro_batch_size=4))
    assert one_epoch.update(make_batch())["offpolicy/steps"] == 1.0  # only the first is on


def test_a_non_finite_step_is_skipped_then_the_run_stops():
    from stppo_agent.training.ppo_update import TrainingDivergedError

    t = update_stage(monitor=dict(max_nan_skips=1))
    updater = t
    bad = make_batch().select([0, 1, 2, 3])
    bad.advantages[0, 0] = math.nan
    before = [p.detach().clone() for p in t.state.actor.parameters()]
    out = updater._optimizer_step(bad)
    assert out["skipped"] == 1.0 and math.isnan(out["grad_norm"])
    assert t.state.optimizer_steps == 0 and t.state.nan_skips_in_a_row == 1 and t.state.nan_skips_total == 1
    assert all(p.grad is None for p in t.state.actor.parameters())
    assert all(torch.equal(p.detach(), b) for p, b in zip(t.state.actor.parameters(), before))
    assert t.report == ["iteration 1: non-finite actor loss or gradient; update skipped (1 in a row)"]
    good = make_batch().select([0, 1, 2, 3])
    assert "skipped" not in updater._optimizer_step(good)
    assert t.state.nan_skips_in_a_row == 0 and t.state.nan_skips_total == 1 and t.state.optimizer_steps == 1
    updater._optimizer_step(bad)
    with pytest.raises(TrainingDivergedError) as info:
        updater._optimizer_step(bad)
    assert str(info.value) == (
        f"2 consecutive updates had NaN/inf losses or gradients; stopping. Checkpoints are in "
        f"{Path('runs/pins/checkpoints')}; the newest may hold the weights that diverged (a skipped update keeps the "
        "last finite weights, not healthy ones). Lower the learning rate, raise optimizer.max_grad_norm headroom, or "
        "check the data and rewards, then --resume, or start a new run from an earlier checkpoint's actor "
        "(--model RUN/checkpoints/step-N/actor).")
    assert t.state.nan_skips_total == 3


def test_only_the_main_process_says_an_update_was_skipped(monkeypatch):
    from stppo_agent.distributed import process_group

    monkeypatch.setattr(process_group, "is_main", lambda: False)
    t = update_stage()
    bad = make_batch().select([0, 1, 2, 3])
    bad.advantages[0, 0] = math.nan
    assert t._optimizer_step(bad)["skipped"] == 1.0 and t.state.nan_skips_in_a_row == 1  # skipped, counted, unsaid
    assert t.report == []


def test_a_non_finite_critic_step_is_skipped_alone():

    t = update_stage()
    mini = make_batch().select([0, 1, 2, 3])
    mini.returns[1, 0] = math.inf
    before = [p.detach().clone() for p in t.state.critic.parameters()]
    out = t._optimizer_step(mini)
    assert out["skipped"] == 1.0 and t.state.optimizer_steps == 1  # the actor stepped
    assert all(torch.equal(p.detach(), b) for p, b in zip(t.state.critic.parameters(), before))
    assert all(p.grad is None for p in t.state.critic.parameters())
    assert t.report == ["iteration 1: non-finite critic loss or gradient; update skipped (1 in a row)"]
    t2 = update_stage(critic=False)
    out = t2._optimizer_step(make_batch().select([0, 1, 2, 3]))
    assert "value_loss" not in out and t2.state.optimizer_steps == 1


def test_a_critic_step_with_finite_losses_and_an_infinite_gradient_is_skipped(monkeypatch):
    import stppo_agent.training.ppo_update as ppo_update

    t = update_stage()
    monkeypatch.setattr(ppo_update.process_group, "clip_grad_norm", lambda params, norm: torch.tensor(math.inf))
    before = [p.detach().clone() for p in t.state.critic.parameters()]
    out = t._critic_step(make_batch().select([0, 1, 2, 3]))
    assert out["skipped"] == 1.0 and math.isinf(out["critic_grad_norm"])
    assert all(torch.equal(p.detach(), b) for p, b in zip(t.state.critic.parameters(), before))


def test_synced_last_skips_the_all_reduce_until_the_last_micro_batch():
    import contextlib

    from stppo_agent.training.ppo_update import PPOUpdate

    events = []

    class Wrapper:
        @contextlib.contextmanager
        def no_sync(self):
            events.append("off")
            yield
            events.append("on")

    for item in PPOUpdate._synced_last(["a", "b", "c"], Wrapper()):
        events.append(item)
    assert events == ["off", "a", "on", "off", "b", "on", "c"]
    assert list(PPOUpdate._synced_last(["a", "b"], None)) == ["a", "b"]
    assert list(PPOUpdate._synced_last(["a", "b"], torch.nn.Linear(1, 1))) == ["a", "b"]


def test_global_counts_are_policy_tokens_and_trajectories_never_zero():

    t = update_stage()
    batch = make_batch()
    tokens, seqs = t._global_counts(batch)
    assert float(tokens) == float(batch.loss_mask.sum()) and float(seqs) == 6.0
    batch.loss_mask[:] = False
    batch.loss_mask[1, 0] = True
    assert [float(x) for x in t._global_counts(batch)] == [1.0, 1.0]
    batch.loss_mask[:] = False
    t.world = 4
    assert [float(x) for x in t._global_counts(batch)] == [0.25, 0.25]


def test_whole_batch_statistics_only_for_m2po_over_several_micro_batches():

    mini = make_batch().select([0, 1, 2, 3])
    t = update_stage("m2po", optimizer=dict(micro_batch_size=1))
    updater = t
    micros = [micro for _, micro in updater._split(mini)]
    assert len(micros) == 4
    keywords = updater._whole_batch_keywords(micros)
    assert len(keywords) == 4 and all(k for k in keywords)
    assert updater._whole_batch_keywords(micros[:1]) == [{}]
    assert update_stage("ppo")._whole_batch_keywords(micros) == [{}, {}, {}, {}]
    grads = []
    for micro in (1, 4):
        t = update_stage("m2po", algorithm={"m2_threshold": 0.02}, optimizer=dict(micro_batch_size=micro))
        mini.old_logprobs = mini.old_logprobs + 0.0
        t.actor_gradients(mini)
        grads.append([p.grad.clone() for p in t.state.actor.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_step_diagnostics_hooks_see_every_micro_batch_and_the_step():

    calls = []

    class Diagnostics:
        def begin_iteration(self, iteration, on_policy_start):
            calls.append(("begin", iteration, on_policy_start))

        def observe_micro(self, micro, logprobs):
            calls.append(("micro", micro.batch_size, logprobs.shape == micro.response_ids.shape))

        def finish_step(self, params, out, steps):
            calls.append(("finish", len(params), "grad_norm" in out, steps))
            return {"diag": 1.0}

    t = update_stage(critic=False, optimizer=dict(mini_batch_size=6, micro_batch_size=2))
    t.state.iteration, t.state.optimizer_steps, t.diagnostics = 4, 7, Diagnostics()
    metrics = t.update(make_batch())
    params = len([p for p in t.state.actor.parameters() if p.requires_grad])
    assert calls == [("begin", 5, True), ("micro", 2, True), ("micro", 2, True), ("micro", 2, True),
                     ("finish", params, True, 7)]
    assert metrics["diag"] == 1.0


# -- stale_policy ---------------------------------------------------------------------------------------------

def test_staleness_zero_generates_with_the_actor_itself():
    from stppo_agent.training.stale_policy import StalePolicy

    actor = torch.nn.Linear(2, 2)
    policy = StalePolicy(actor, 0)
    assert policy.model is actor and policy.lag == 0 and policy.state(actor) == {}
    assert actor.training and actor.weight.requires_grad
    policy.advance(actor)
    assert policy.lag == 0 and not policy.pending
    policy.load(None, actor)  # nothing to restore
    with pytest.raises(ValueError, match=r"^rollout.staleness must be >= 0, got -1$"):
        StalePolicy(actor, -1)


def test_iteration_i_generates_with_the_weights_after_i_minus_k_updates():
    from stppo_agent.training.stale_policy import StalePolicy

    actor = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        actor.weight.fill_(0.0)
    policy = StalePolicy(actor, 2)
    assert policy.model is not actor and not policy.model.training
    assert not any(p.requires_grad for p in policy.model.parameters()) and actor.weight.requires_grad
    assert policy.state(actor)["pending"] == [] and float(policy.state(actor)["model"]["weight"]) == 0.0
    assert not policy.state(actor)["pending_from_actor"]  # nothing queued yet
    generating = []
    for update in range(1, 6):  # iteration update-1 plays, then the actor takes its update-th step
        generating.append(float(policy.model.weight))
        with torch.no_grad():
            actor.weight.fill_(float(update))
        policy.advance(actor)
        assert policy.lag == min(2, update)
    assert generating == [0.0, 0.0, 0.0, 1.0, 2.0]  # max(0, i - 2) updates
    state = policy.state(actor)
    # the newest queued weights (5.0) are the actor's own: the checkpoint's actor restores them
    assert float(state["model"]["weight"]) == 3.0 and [float(s["weight"]) for s in state["pending"]] == [4.0]
    assert state["pending_from_actor"] and state["aliases"] == {}
    with torch.no_grad():
        policy.model.weight.fill_(-1.0)
    assert float(state["model"]["weight"]) == 3.0  # a copy, not the live tensor
    fresh = StalePolicy(actor, 2)
    fresh.load(state, actor)
    assert float(fresh.model.weight) == 3.0 and fresh.lag == 2
    assert [float(s["weight"]) for s in fresh.pending] == [4.0, 5.0]
    with torch.no_grad():
        actor.weight.fill_(6.0)  # another update: the queued actor weights were a copy too
    assert float(fresh.pending[-1]["weight"]) == 5.0
    other = StalePolicy(actor, 2)
    other.load({**state, "pending_from_actor": False}, actor)  # a queue stored whole (older checkpoints)
    assert [float(s["weight"]) for s in other.pending] == [4.0]
    with pytest.raises(ValueError, match=r"^the checkpoint holds no lagged policy, but rollout.staleness is 2"):
        fresh.load({}, actor)


def test_the_lagged_copy_keeps_the_autocast_of_the_run():
    from stppo_agent.models.precision import autocast_forward
    from stppo_agent.training.stale_policy import StalePolicy

    actor = autocast_forward(tiny_lm(), "bfloat16")
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        want = actor(input_ids=ids).logits
        got = StalePolicy(actor, 1, "bfloat16").model(input_ids=ids).logits
        plain = StalePolicy(actor, 1, None).model(input_ids=ids).logits
    assert torch.equal(got, want) and not torch.equal(plain, want)


# -- resampling -------------------------------------------------------------------------------------------------

def group_batch(groups):
    """One trajectory per reward, ``groups`` = [(group_id, [rewards])]."""
    from stppo_agent.rollouts.batch import Trajectory, to_batch

    trajectories = []
    for gid, rewards in groups:
        for reward in rewards:
            t = Trajectory(env=None, group_id=gid, prompt_ids=[3], reward=reward)
            t.append([4, 5][: 1 + gid % 2], policy=True, turn=0)
            trajectories.append(t)
    return to_batch(trajectories, pad_id=0)


def test_uninformative_groups_are_replaced_until_the_batch_is_full():
    from stppo_agent.training.resampling import keep_informative_groups

    first = group_batch([(0, [1.0, 1.0]), (1, [0.0, 1.0]), (2, [0.0, 0.0])])
    first.stats = {"reward": 0.5}
    rounds = {1: group_batch([(10, [1.0, 1.0]), (11, [1.0, 0.0])]),
              2: group_batch([(20, [0.0, 1.0]), (21, [0.5, 0.0])])}
    played = []
    batch = keep_informative_groups(first, lambda r: played.append(r) or rounds[r], max_rounds=5, pad_id=0)
    assert played == [1, 2]
    assert batch.group_ids.tolist() == [1, 1, 11, 11, 20, 20]
    assert batch.rewards.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert batch.stats == {"reward": 0.5, "dynamic_sampling/rounds": 2.0, "dynamic_sampling/dropped_frac": 3 / 7}


def test_the_round_cap_fills_the_batch_with_dropped_groups_in_sampling_order():
    from stppo_agent.training.resampling import keep_informative_groups

    first = group_batch([(0, [1.0, 1.0]), (1, [0.0, 1.0]), (2, [0.0, 0.0])])
    more = group_batch([(10, [1.0, 1.0]), (11, [1.0, 0.0])])
    batch = keep_informative_groups(first, lambda r: more, max_rounds=1, pad_id=0)
    assert batch.group_ids.tolist() == [1, 1, 11, 11, 0, 0]
    assert batch.stats["dynamic_sampling/rounds"] == 1.0
    assert batch.stats["dynamic_sampling/dropped_frac"] == 3 / 5
    played = []
    uncapped = keep_informative_groups(  # 0: no cap (verl's meaning): rounds until the batch is full
        first, lambda r: played.append(r) or group_batch([(10 * r + 1, [0.0, 1.0])]), max_rounds=0, pad_id=0)
    assert played == [1, 2] and uncapped.group_ids.tolist() == [1, 1, 11, 11, 21, 21]
    assert uncapped.stats["dynamic_sampling/rounds"] == 2.0
    assert uncapped.stats["dynamic_sampling/dropped_frac"] == 2 / 5
    full = group_batch([(0, [1.0, 0.0]), (1, [0.0, 1.0])])
    kept = keep_informative_groups(full, lambda r: pytest.fail("the batch is full"), max_rounds=3, pad_id=0)
    assert kept.group_ids.tolist() == [0, 0, 1, 1] and kept.stats["dynamic_sampling/dropped_frac"] == 0.0


# -- live_rollouts ----------------------------------------------------------------------------------------------

def test_the_prompt_sampler_walks_a_seeded_permutation_per_epoch():
    import numpy as np

    from stppo_agent.training.live_rollouts import PromptSampler

    sampler = PromptSampler([2, 3], seed=4)
    pairs = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert sampler.pairs == pairs and sampler.state() == {"epoch": 0, "cursor": 0}
    first, second = (np.random.default_rng(4 + e).permutation(5).tolist() for e in (0, 1))
    assert sampler.take(3) == [pairs[i] for i in first[:3]] and sampler.state() == {"epoch": 0, "cursor": 3}
    assert sampler.take(2) == [pairs[i] for i in first[3:]] and sampler.state() == {"epoch": 1, "cursor": 0}
    assert sampler.take(0) == []
    assert sampler.take(7) == [pairs[i] for i in second] + [pairs[i] for i in
                                                            np.random.default_rng(6).permutation(5)[:2].tolist()]
    assert sampler.state() == {"epoch": 2, "cursor": 2}
    resumed = PromptSampler([2, 3], seed=4)
    resumed.load({"epoch": 1.0, "cursor": 3.0})
    assert resumed.state() == {"epoch": 1, "cursor": 3} and type(resumed.state()["epoch"]) is int
    assert type(resumed.state()["cursor"]) is int
    assert resumed.take(2) == [pairs[i] for i in second[3:]]


def live(env="stppo/Toy-v0", env_kwargs=None, backend=None, **values):
    """Live rollouts over a backend that holds its own weights (an engine's, which needs nothing gathered); their
    phases are a :class:`Said` list."""
    from pathlib import Path

    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.rollouts.vllm_generation import VLLMGenerationBackend
    from stppo_agent.training.live_rollouts import LiveRollouts, RolloutContext

    cfg = config(env=env, env_kwargs=env_kwargs or {}, **values)
    backend = backend or VLLMGenerationBackend.__new__(VLLMGenerationBackend)
    return LiveRollouts(RolloutContext(cfg, cfg.algorithm_config(), Path("runs/pins"), word_tokenizer(), backend,
                                       phase=Said()))


def test_live_rollouts_build_one_env_per_slot_sharing_the_search_envs_retriever():

    from .conftest import KeywordRetriever

    retriever = KeywordRetriever()
    rollouts = live(" stppo/NQ-v0 , stppo/HotpotQA-v0,", {"retriever": retriever, "topk": 2}, rollout=dict(max_turns=3))
    assert rollouts.env_ids == ["stppo/NQ-v0", "stppo/HotpotQA-v0"]
    assert rollouts.env_kwargs == [{"retriever": retriever, "topk": 2, "max_turns": 3}] * 2
    sizes = [len(rollouts._env(0, i).examples) for i in (0, 1)]
    assert len(rollouts.sampler.pairs) == sum(sizes) and rollouts.sampler.seed == 0
    env = rollouts._env(3, 1)
    assert env is rollouts._env(3, 1) and env is not rollouts._env(2, 1) and env is not rollouts._env(3, 0)
    assert env.retriever is retriever and env.max_turns == 3 and env.topk == 2
    toy = live("stppo/Toy-v0", {"turns": 3}, seed=9)
    assert toy.env_kwargs == [{"turns": 3}] and toy.sampler.pairs == [(0, 0)] and toy.sampler.seed == 9
    assert toy._env(0, 0).turns == 3
    with pytest.raises(ValueError, match=r"^env is empty; pass one or more env ids, e\.g\. stppo/NQ-v0,"
                                         r"stppo/HotpotQA-v0$"):
        live(" , ")


def test_a_search_env_spec_becomes_one_shared_retriever(monkeypatch):
    import stppo_agent.training.live_rollouts as live_rollouts

    specs = []
    share = live_rollouts.shared_retriever_spec
    monkeypatch.setattr(live_rollouts, "shared_retriever_spec", lambda spec, run_dir: specs.append((spec, run_dir))
                        or share(spec, run_dir))
    rollouts = live("stppo/NQ-v0", {"topk": 1})
    assert specs == [("demo", rollouts.context.run_dir)]
    retriever = rollouts.env_kwargs[0]["retriever"]
    assert not isinstance(retriever, str) and rollouts._env(0, 0).retriever is retriever
    assert rollouts._env(1, 0).retriever is retriever  # one index in memory for every slot
    live("stppo/Toy-v0")
    live("stppo/NQ-v0", {"topk": 1}, distributed=dict(share_retriever=False))
    assert len(specs) == 1  # neither a toy env nor share_retriever=false asks for a shared spec


def recording_collect(calls, rewards=lambda round, groups: [1.0] * len(groups)):
    def collect(backend, tokenizer, envs, options, groups, limits, seeds, on_turn):
        calls.append(dict(envs=envs, options=options, groups=groups, limits=limits, seeds=seeds, backend=backend,
                          tokenizer=tokenizer))
        on_turn(1, 4)
        round = (groups[0] // 10**9) if groups else 0
        return group_batch([(g, [r]) for g, r in zip(groups, rewards(round, groups))])
    return collect


def test_a_round_assigns_slots_groups_and_seeds(monkeypatch):
    import stppo_agent.training.live_rollouts as live_rollouts

    calls = []
    monkeypatch.setattr(live_rollouts, "collect_rollouts", recording_collect(calls))
    rollouts = live(seed=5, rollout=dict(prompts_per_iteration=2, samples_per_prompt=3, max_turns=4))
    rollouts._play(2, 0)
    rollouts._play(2, 1)
    own, extra = calls
    assert own["groups"] == [4, 4, 4, 5, 5, 5] and extra["groups"] == [10**9 + 4] * 3 + [10**9 + 5] * 3
    assert own["seeds"] == [5 + 2_000_006 + slot for slot in range(6)]
    assert extra["seeds"] == [5 + 2_000_006 + slot + 7_919_993 for slot in range(6)]
    assert own["options"] == [{"index": 0}] * 6 and own["limits"] == rollouts.context.config.rollout_limits()
    assert len({id(env) for env in own["envs"]}) == 6
    assert [id(e) for e in own["envs"]] == [id(e) for e in extra["envs"]]  # the same slots, the same envs
    assert rollouts.context.phase == ["rollout turn 2/4 done (4 active)"] * 2
    assert rollouts.state() == {"epoch": 4, "cursor": 0}  # one example: each prompt is an epoch
    rollouts.load({"epoch": 1, "cursor": 0})
    assert rollouts.sampler.state() == {"epoch": 1, "cursor": 0}
    assert own["backend"] is rollouts.context.backend and own["tokenizer"] is rollouts.context.tokenizer


def test_hf_generation_holds_the_gathered_actor(monkeypatch):
    import contextlib

    import stppo_agent.rollouts.hf_generation as hf_generation
    import stppo_agent.training.live_rollouts as live_rollouts

    calls, held = [], []

    @contextlib.contextmanager
    def gathered(model):
        held.append(model)
        yield model

    monkeypatch.setattr(live_rollouts, "collect_rollouts", recording_collect(calls))
    monkeypatch.setattr(hf_generation.process_group, "gathered", gathered)
    live()._play(0, 0)
    assert held == [] and len(calls) == 1  # an engine with its own weights (vLLM) needs no gathered actor
    hf = hf_generation.HFGenerationBackend.__new__(hf_generation.HFGenerationBackend)
    hf.model = actor = torch.nn.Linear(1, 1)
    live(backend=hf)._play(0, 0)
    assert held == [actor] and calls[-1]["backend"] is hf


def test_each_rank_plays_its_share_of_the_prompts(monkeypatch):
    import stppo_agent.training.live_rollouts as live_rollouts

    calls = []
    monkeypatch.setattr(live_rollouts, "collect_rollouts", recording_collect(calls))
    rollouts = live(seed=0, rollout=dict(prompts_per_iteration=4, samples_per_prompt=2))
    rollouts.context = dataclasses_replace(rollouts.context, rank=1, world=2)
    rollouts._play(0, 0)
    assert calls[0]["groups"] == [1, 1, 3, 3] and calls[0]["seeds"] == [2, 3, 6, 7]


def test_dynamic_sampling_resamples_rounds_and_the_search_error_rate_stops_the_run(monkeypatch):
    import stppo_agent.training.live_rollouts as live_rollouts
    from stppo_envs.retrieval import RetrievalError

    calls = []
    informative_from = lambda round, groups: [float(round >= 2 and i % 2) for i in range(len(groups))]  # noqa: E731
    monkeypatch.setattr(live_rollouts, "collect_rollouts", recording_collect(calls, informative_from))
    rollouts = live(algo="dapo", rollout=dict(prompts_per_iteration=2, samples_per_prompt=2))
    batch = rollouts.next_batch(0)
    assert [c["groups"][0] // 10**9 for c in calls] == [0, 1, 2]
    assert batch.stats["dynamic_sampling/rounds"] == 2.0
    assert batch.group_ids.tolist() == [2 * 10**9, 2 * 10**9, 2 * 10**9 + 1, 2 * 10**9 + 1]
    capped = live(algo="dapo", algorithm={"max_resample_rounds": 1},
                  rollout=dict(prompts_per_iteration=2, samples_per_prompt=2))
    calls.clear()
    capped.next_batch(0)
    assert len(calls) == 2
    calls.clear()
    live(algo="grpo", rollout=dict(samples_per_prompt=2)).next_batch(0)
    assert len(calls) == 1  # no dynamic sampling
    rates = {}
    monkeypatch.setattr(live_rollouts, "rollout_statistics", lambda batch, algo: rates)
    rollouts = live(env_kwargs={"turns": 2}, monitor=dict(max_search_error_rate=0.25))
    rollouts.next_batch(0)  # no searches: no rate
    rates["search_error_rate"] = 0.25
    rollouts.next_batch(0)
    rates["search_error_rate"] = 0.26
    with pytest.raises(RetrievalError, match=r"^iteration 3: 26% of the searches failed "
                                             r"\(monitor.max_search_error_rate=0.25\); the policy would learn from "
                                             r"error messages. Check the retriever \(demo\), then --resume"):
        rollouts.next_batch(2)
    rollouts.context.config.env_kwargs = {"retriever": "http://retriever:8000"}
    with pytest.raises(RetrievalError, match=r"Check the retriever \(http://retriever:8000\), then --resume from the "
                                             r"last checkpoint$"):
        rollouts.next_batch(2)


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


# -- sft --------------------------------------------------------------------------------------------------------

TRANSCRIPT = [{"role": "user", "text": "say red", "turn": -1},
              {"role": "assistant", "text": "ok red", "turn": 0},
              {"role": "env", "text": "green blue gold red", "turn": 0},
              {"role": "assistant", "text": "", "turn": 1},
              {"role": "env", "text": "", "turn": 1},
              {"role": "assistant", "text": "gold", "turn": 2}]


def test_a_transcript_becomes_the_tokens_of_a_rollout():
    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.rollouts.turn_loop import encode_prompt
    from stppo_agent.training.sft import trajectory_from_transcript

    tok = word_tokenizer()
    ids = {w: tok.convert_tokens_to_ids(w) for w in ("say", "ok", "red", "green", "blue", "gold")}
    t = trajectory_from_transcript(tok, TRANSCRIPT, 2)
    assert t.prompt_ids == encode_prompt(tok, "say red") and t.group_id == 0 and t.env is None
    assert t.response_ids == [ids["ok"], ids["red"], ids["green"], ids["blue"], ids["gold"]]
    assert t.policy_mask == [True, True, False, False, True] and t.turn_ids == [0, 0, -1, -1, 2]
    assert trajectory_from_transcript(tok, TRANSCRIPT, 4).response_ids[2:6] == [ids[w] for w in
                                                                              ("green", "blue", "gold", "red")]
    for bad in ([], [{"role": "assistant", "text": "x", "turn": 0}]):
        with pytest.raises(ValueError, match="^a transcript starts with the user prompt$"):
            trajectory_from_transcript(tok, bad, 2)


@pytest.mark.parametrize("keep", [True, False])
def test_the_sft_loss_reads_the_action_tokens_only(keep):
    from stppo_agent.training.log_probs import token_logprobs
    from stppo_agent.training.sft import action_logprobs

    model = tiny_lm().eval()
    batch = make_batch()
    with torch.no_grad():
        got = action_logprobs(model if keep else NoKeep(model), batch)
        want, _ = token_logprobs(model, batch)
    assert got.shape == (int(batch.loss_mask.sum()),)
    assert torch.allclose(got, want[batch.loss_mask], atol=1e-5)


def test_demonstrations_are_the_rewarded_episodes_of_every_benchmark(monkeypatch):
    import stppo_agent.training.sft as sft

    seen = []

    def evaluate(teacher, settings):
        seen.append((teacher, settings))
        return {"episodes": [{"reward": 1.0, "transcript": [settings.benchmark, 1]},
                             {"reward": 0.0, "transcript": [settings.benchmark, 2]},
                             {"reward": 0.5, "transcript": [settings.benchmark, 3]}]}

    monkeypatch.setattr(sft, "evaluate_benchmark", evaluate)
    cfg = sft.SFTConfig(model="m", output_dir="o", benchmarks=("nq", "hotpotqa"), datasets={"nq": "nq.jsonl"},
                        split="dev", limit=5, teacher="hf:big", retriever="bm25:x", topk=2, max_turns=3, seed=3)
    assert sft.demonstrations(cfg) == [["nq", 1], ["nq", 3], ["hotpotqa", 1], ["hotpotqa", 3]]
    teacher, settings = seen[0]
    assert teacher == "hf:big" and seen[1][1].benchmark == "hotpotqa" and seen[1][1].dataset is None
    assert (settings.benchmark, settings.dataset, settings.split, settings.limit, settings.retriever, settings.topk,
            settings.max_turns, settings.seed) == ("nq", "nq.jsonl", "dev", 5, "bm25:x", 2, 3, 3)
    monkeypatch.setattr(sft, "evaluate_benchmark", lambda teacher, settings: {"episodes": [
        {"reward": 0.0, "transcript": []}]})
    with pytest.raises(ValueError, match=r"^the teacher 'hf:big' earned no reward on nq, hotpotqa: no demonstrations"):
        sft.demonstrations(cfg)


def test_sft_settings_are_checked_before_any_episode(monkeypatch):
    import stppo_agent.training.sft as sft

    monkeypatch.setattr(sft, "demonstrations", lambda config: pytest.fail("validated first"))
    for values, message in (({"steps": 0}, r"^steps and batch_size must be >= 1$"),
                            ({"batch_size": 0}, r"^steps and batch_size must be >= 1$"),
                            ({"max_observation_tokens": 0}, r"^max_observation_tokens must be >= 1, got 0$"),
                            ({"max_total_tokens": 0}, r"^max_total_tokens must be >= 1, got 0$"),
                            ({"autocast_dtype": "float16"}, r"^autocast_dtype=float16 is refused"),
                            ({"dtype": "float16"}, r"^dtype=float16 is refused")):
        with pytest.raises(ValueError, match=message):
            sft.train_sft(sft.SFTConfig(model="m", output_dir="o", **values))


def sft_run(monkeypatch, tmp_path, transcripts, **values):
    import stppo_agent.training.sft as sft
    from stppo_agent.models.tiny import word_tokenizer

    batches, models = [], []
    monkeypatch.setattr(sft, "demonstrations", lambda config: transcripts)
    monkeypatch.setattr(sft, "load_tokenizer", lambda path: word_tokenizer())
    monkeypatch.setattr(sft, "load_actor", lambda path, dtype: models.append((path, dtype)) or tiny_lm(2))
    to_batch = sft.to_batch

    def record(trajectories, pad):
        batches.append(to_batch(trajectories, pad))
        return batches[-1]

    monkeypatch.setattr(sft, "to_batch", record)
    reports = []
    cfg = sft.SFTConfig(model="m", output_dir=str(tmp_path / "out"), device="cpu", progress=False, **values)
    return sft.train_sft(cfg, report=reports.append), batches, models, reports


def test_sft_trains_shuffled_passes_and_saves_the_model(monkeypatch, tmp_path, capsys):
    import json

    transcripts = [[TRANSCRIPT[0], {"role": "assistant", "text": word, "turn": 0}]
                   for word in ("red", "green", "blue", "gold ok say red green")]
    summary, batches, models, reports = sft_run(monkeypatch, tmp_path, transcripts, steps=3, batch_size=2,
                                                   max_total_tokens=4, lr=0.01, seed=1)
    assert models == [("m", "float32")]
    assert "warm start" not in capsys.readouterr().err  # progress=False: no bar
    assert reports[0] == "sft: 3 demonstrations by gold-search (1 over max_total_tokens skipped), 3 steps of 2"
    assert reports[1].startswith("sft step 1/3: loss ") and len(reports) == 2
    assert [b.batch_size for b in batches] == [2, 2, 2]
    flat = [tuple(ids) for b in batches for ids in b.response_ids.tolist()]
    assert len(set(flat[:3])) == 3  # the first pass shows each demonstration once
    assert summary["demonstrations"] == 3 and summary["seconds"] > 0 and summary["config"]["lr"] == 0.01
    out = tmp_path / "out"
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    losses = json.loads((out / "sft_losses.json").read_text())
    assert len(losses) == 3 and losses[0] == summary["first_loss"] and losses[-1] == summary["last_loss"]
    assert json.loads((out / "sft.json").read_text())["demonstrations"] == 3
    from transformers import AutoModelForCausalLM

    from stppo_agent.training.log_probs import token_logprobs

    saved, start = AutoModelForCausalLM.from_pretrained(out), tiny_lm(2)
    with torch.no_grad():
        first = batches[0]
        assert summary["first_loss"] == pytest.approx(-float(token_logprobs(start, first)[0][first.loss_mask].mean()),
                                                      rel=1e-5)  # the mean NLL of the action tokens alone
        moved = max(float((a - b).abs().max()) for a, b in zip(saved.parameters(), start.parameters()))
    assert 0.005 < moved < 0.05  # three AdamW steps of lr 0.01


@pytest.mark.filterwarnings("error::UserWarning")  # the error message must not warn (float() of a grad tensor did)
def test_sft_reports_progress_through_on_step_and_stops_on_a_non_finite_loss(monkeypatch, tmp_path):
    import stppo_agent.training.sft as sft
    from stppo_agent.models.tiny import word_tokenizer

    transcripts = [[TRANSCRIPT[0], {"role": "assistant", "text": "red", "turn": 0}]]
    monkeypatch.setattr(sft, "demonstrations", lambda config: transcripts)
    monkeypatch.setattr(sft, "load_tokenizer", lambda path: word_tokenizer())
    monkeypatch.setattr(sft, "load_actor", lambda path, dtype: tiny_lm(2))
    steps, reports = [], []
    cfg = sft.SFTConfig(model="m", output_dir=str(tmp_path / "out"), device="cpu", progress=False, steps=11,
                        batch_size=1)
    summary = sft.train_sft(cfg, report=reports.append, on_step=lambda *a: steps.append(a))
    assert [s[:2] for s in steps] == [(i, 11) for i in range(12)] and math.isnan(steps[0][2])
    assert [s[2] for s in steps[1:]] == json_losses(tmp_path / "out") and len(reports) == 1
    assert summary["first_loss"] > summary["last_loss"]  # one demonstration, eleven steps: it is learned
    reports.clear()
    sft.train_sft(dataclasses_replace(cfg, steps=10), report=reports.append)
    assert [r.split(":")[0] for r in reports[1:]] == ["sft step 1/10", "sft step 10/10"]
    monkeypatch.setattr(sft, "action_logprobs", lambda model, batch: torch.full((2,), math.nan, requires_grad=True))
    with pytest.raises(FloatingPointError, match=r"^sft step 1: the loss is nan; lower --lr$"):
        sft.train_sft(cfg, report=reports.append)
    with pytest.raises(ValueError, match=r"^every demonstration is longer than max_total_tokens=2$"):
        sft.train_sft(dataclasses_replace(cfg, max_total_tokens=2), report=reports.append)


def json_losses(folder):
    import json

    return json.loads((folder / "sft_losses.json").read_text())


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


# -- trainer ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer

    return build_tiny_llama(tmp_path_factory.mktemp("pins_tiny") / "model", word_tokenizer(), hidden=8, layers=1)


def toy_run(model, out, **values):
    settings = dict(algo="ppo", env="stppo/Toy-v0", model=str(model), output_dir=str(out), iterations=3, seed=11,
                    algorithm={"kl_in_reward": 0.0, "kl_loss_coef": 0.0},
                    rollout=dict(prompts_per_iteration=2, samples_per_prompt=2, max_turns=2, max_new_tokens_per_turn=1,
                                 max_prompt_tokens=8, max_total_tokens=16),
                    optimizer=dict(mini_batch_size=4, micro_batch_size=2, actor_lr=0.01),
                    logging=dict(progress=False, tensorboard=False), checkpoint=dict(every=2, keep=5))
    return from_dict(merged(settings, values))


def test_a_short_run_trains_logs_and_checkpoints_every_save_every_and_at_the_end(tiny_folder, tmp_path,
                                                                               monkeypatch):
    import stppo_agent.training.trainer as trainer_module
    from stppo_agent.runs.metrics_log import read_metrics
    from stppo_agent.training.trainer import Trainer

    loggers, logger = [], trainer_module.MetricsLogger

    def metrics_logger(run_dir, tensorboard, wandb_project, config):  # W&B and TensorBoard stay off here
        loggers.append((run_dir, tensorboard, wandb_project, config))
        return logger(run_dir, tensorboard=False, wandb_project=None, config=config)

    monkeypatch.setattr(trainer_module, "MetricsLogger", metrics_logger)
    reports, batches = [], []
    trainer = Trainer(toy_run(tiny_folder, tmp_path, device="cpu", rollout=dict(staleness=1),
                              logging=dict(save_rollouts=True, step_diagnostics=True, tensorboard=True,
                                           wandb_project="pins"), precision=dict(autocast_dtype="auto")),
                      report=reports.append, batch_hook=batches.append)
    assert [entry[:3] for entry in loggers] == [(tmp_path, True, "pins")] and loggers[0][3]["seed"] == 11
    assert torch.initial_seed() == 11 and trainer.config.precision.autocast_dtype in (None, "bfloat16")  # auto resolved
    state = trainer.state
    assert (state.iteration, state.optimizer_steps, state.nan_skips_in_a_row, state.nan_skips_total,
            state.actor_lr_scale, trainer.rank, trainer.world, trainer.sharded) == (0, 0, 0, 0, 1.0, 0, 1, False)
    assert trainer.algo.advantage == "gae" and trainer.run_dir == tmp_path and trainer.device.type == "cpu"
    assert trainer.guard is not None and trainer.diagnostics is not None and trainer.recorder is not None
    assert trainer.state.full_states(trainer.sharded) == (None, None)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["algorithm"]["advantage"] == "gae" and len(saved["algorithm"]) >= 15
    assert saved["precision"]["autocast_dtype"] == trainer.config.precision.autocast_dtype
    synced = []

    class Engine:  # a backend with its own copy of the weights (vLLM's role), generating through the HF one
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def sync_weights(self, actor):
            synced.append(actor)

    trainer.backend = Engine(trainer.backend)
    last = trainer.train()
    assert synced == [trainer.state.actor] * 3  # after every update
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and (state.iteration, state.optimizer_steps) == (3, 3)
    assert [r["staleness"] for r in records] == [0, 1, 1]
    assert last["reward"] == records[-1]["reward"] and last["staleness"] == 1  # train() returns the last metrics
    for r in records:
        assert 0 < r["rollout_seconds"] <= r["iteration_seconds"]
        assert r["rollout_tokens_per_s"] == pytest.approx(r["response_tokens"] * 4 / r["rollout_seconds"], rel=1e-6)
    assert len(batches) == 3 and all(b.batch_size == 4 for b in batches)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-")) == \
        ["step-2", "step-3"]
    assert (tmp_path / "steps.jsonl").exists() and (tmp_path / "rollouts").is_dir()
    assert trainer._bar is None


def test_a_resumed_run_continues_and_one_as_long_as_asked_says_so(tiny_folder, tmp_path, capsys):
    import shutil

    from stppo_agent.runs.metrics_log import read_metrics
    from stppo_agent.training.trainer import Trainer

    Trainer(toy_run(tiny_folder, tmp_path, iterations=2, monitor=dict(on_collapse="none"), checkpoint=dict(every=1),
                    logging=dict(progress=True)),
            report=lambda _: None).train()
    bar = capsys.readouterr().err
    assert "training: 100%" in bar and " 2/2 " in bar and "scoring" in bar  # the progress bar
    assert "it/s" in bar or "s/it" in bar
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and not any("staleness" in r for r in records)
    assert not any("gpu_peak_memory_gib" in r for r in records)  # a CUDA-only metric
    assert not (tmp_path / "tensorboard").exists() and "training" not in capsys.readouterr().err  # both off
    shutil.rmtree(tmp_path / "checkpoints" / "step-2")  # as if killed before the second checkpoint
    reports = []
    again = Trainer(toy_run(tiny_folder, tmp_path, iterations=1, monitor=dict(on_collapse="none")), resume=True,
                    report=reports.append)
    assert (again.state.iteration, again.state.optimizer_steps) == (1, 1)
    assert again.guard is None and again.diagnostics is None
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]  # the records after the checkpoint are dropped
    assert again.train() == {}
    assert reports[-1] == (f"nothing to train: {tmp_path} is at iteration 1 and iterations=1; --iterations 2 or more "
                           "continues it")
    longer = Trainer(toy_run(tiny_folder, tmp_path, iterations=2, monitor=dict(on_collapse="none"),
                             checkpoint=dict(keep=1)),
                     resume=True, report=lambda _: None)
    longer.train()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2] and longer.state.optimizer_steps == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-2"]
    with pytest.raises(Exception, match="resume|overwrite"):
        Trainer(toy_run(tiny_folder, tmp_path, iterations=2), report=lambda _: None)
    fresh = Trainer(toy_run(tiny_folder, tmp_path, iterations=2), overwrite=True, report=lambda _: None)
    assert fresh.state.iteration == 0 and read_metrics(tmp_path) == []


def test_a_bad_config_fails_before_the_run_folder_is_touched(tmp_path):
    from stppo_agent.training.trainer import Trainer

    with pytest.raises(ValueError, match="rollout.samples_per_prompt >= 2"):
        Trainer(toy_run("nowhere", tmp_path / "run", algo="grpo", rollout=dict(samples_per_prompt=1)))
    assert not (tmp_path / "run").exists()


class Recording:
    """A collaborator of the loop (rollout source, recorder, update, learning-signal notice) that records its calls."""

    sampled_by_actor = False
    env_kwargs = None

    def __init__(self, calls: list, batch=None):
        self.calls, self.batch = calls, batch

    def next_batch(self, iteration):
        self.calls.append(("next", iteration))
        return self.batch

    def record(self, iteration, batch):
        self.calls.append(("record", iteration, batch is self.batch))

    def update(self, batch, on_policy_start):
        return "update", batch, on_policy_start

    def actor_gradients(self, mini):
        return "gradients", mini

    def check(self, batch, iteration):
        self.calls.append(("signal", batch, iteration))


def test_the_trainer_stages_get_what_they_need_in_order(tiny_folder, tmp_path, monkeypatch):
    import stppo_agent.training.trainer as trainer_module
    from stppo_agent.monitoring.collapse_guard import CollapseGuard
    from stppo_agent.training.trainer import Trainer

    trainer = Trainer(toy_run(tiny_folder, tmp_path, monitor=dict(on_collapse="none"),
                              rollout=dict(old_logprobs="sampler")),
                      report=lambda _: None)
    calls = []
    batch = SimpleNamespace(to=lambda device: calls.append(("to", device)) or "moved")
    trainer.state.iteration = 4
    trainer.phase = lambda text: calls.append(("phase", text))
    trainer.source = trainer.recorder = trainer.updater = trainer.learning_signal = Recording(calls, batch)
    trainer.batch_hook = lambda b: calls.append(("hook", b is batch))
    assert trainer.rollout() == "moved"
    assert calls == [("phase", "rollout"), ("next", 4), ("record", 5, True), ("hook", True), ("to", trainer.device)]
    trainer.recorder = trainer.batch_hook = None
    calls.clear()
    trainer.rollout()
    assert calls == [("phase", "rollout"), ("next", 4), ("to", trainer.device)]
    # the sampler's own log-probs, sampled by another rule (a replay): not on-policy from the first step
    assert trainer.update("b") == ("update", "b", False) and trainer.actor_gradients("m") == ("gradients", "m")
    trainer.source.sampled_by_actor = True
    assert trainer.update("b") == ("update", "b", True)
    scored = []
    monkeypatch.setattr(trainer_module, "score_batch", lambda b, **kw: scored.append((b, kw)))
    calls.clear()
    the_batch = SimpleNamespace(batch_size=8)
    trainer.score(the_batch)
    state = trainer.state
    assert scored == [(the_batch, dict(config=trainer.config, algo=trainer.algo, actor=state.actor,
                                       generator=state.stale_policy.model, reference=state.reference,
                                       critic=state.critic, device=trainer.device, world=1,
                                       old_from_update=False))]  # only the training loop asks for it
    assert calls == [("signal", the_batch, 4)]
    saved = []
    state.save = lambda run_dir, config, algo, **kw: saved.append((run_dir, config, algo, kw)) or "path"
    assert trainer.save() == "path" and saved == [(tmp_path, trainer.config, trainer.algo,
                                                   dict(sharded=False, protect=()))]
    trainer.guard = CollapseGuard(trainer.config, tmp_path)
    trainer.guard.protected_steps = lambda: (2, 4)
    trainer.save()
    assert saved[-1][3] == dict(sharded=False, protect=(2, 4))


def test_phase_shows_on_the_bar_only_while_it_is_shown(tiny_folder, tmp_path):
    from stppo_agent.training.trainer import Trainer

    trainer = Trainer(toy_run(tiny_folder, tmp_path, monitor=dict(on_collapse="none")), report=lambda _: None)
    bar = RecordedBar(disable=False)
    trainer._bar = bar
    trainer.phase("scoring")
    assert bar.phases == ["scoring"] and bar.refreshed == [True]
    bar.disable = True
    trainer.phase("x")
    trainer._bar = None
    trainer.phase("y")
    assert bar.phases == ["scoring"]


# -- scoring (mutmut skips score_batch: it is decorated with torch.no_grad) ---------------------------------------

def scoring_inputs(algo="ppo", reference=True, critic=True, **values) -> dict:
    """What score_batch takes: the config, tiny actor, critic, reference and lagged generator (other weights than
    the actor's), on the CPU, one process."""
    values = merged({"rollout": {"temperature": 0.7},
                     "optimizer": {"micro_batch_size": 2, "mini_batch_size": 4, "max_grad_norm": 1e6}}, values)
    cfg = config(algo=algo, **values)
    return dict(config=cfg, algo=cfg.algorithm_config(), actor=tiny_lm(0), generator=tiny_lm(5).eval(),
                reference=tiny_lm(6).eval() if reference else None,
                critic=tiny_lm(1, critic=True) if critic else None, device=torch.device("cpu"), world=1)


def expected_scores(t, batch, behaviour, sampler=None):
    """``behaviour``: the ratio's denominator; ``sampler`` (default: the same): the weights that sampled the batch,
    whose KL to the reference the reward's penalty is."""
    from stppo_agent.algorithms import estimate_advantages, kl_reward_penalty
    from stppo_agent.training.log_probs import critic_values, token_logprobs

    sampling, algo, reference, critic = t["config"].sampling(), t["algo"], t["reference"], t["critic"]
    with torch.no_grad():
        old = token_logprobs(behaviour.eval(), batch, sampling=sampling)[0]
        sampled = old if sampler is None else token_logprobs(sampler.eval(), batch, sampling=sampling)[0]
        ref = token_logprobs(reference, batch, sampling=sampling)[0] if reference is not None else None
        values = critic_values(critic.eval(), batch) if critic is not None else torch.zeros_like(old)
        penalty = kl_reward_penalty(sampled, ref, batch.loss_mask, algo) \
            if algo.kl_in_reward > 0 and ref is not None else None
        adv, ret = estimate_advantages(algo.advantage, rewards=batch.rewards, values=values,
                                       loss_mask=batch.loss_mask, group_ids=batch.group_ids, config=algo,
                                       kl_penalty=penalty, turn_ids=batch.turn_ids)
    return old, ref, values, adv, ret


@pytest.mark.parametrize("objective", ["coupled", "decoupled"])
def test_scoring_takes_old_logprobs_from_the_behaviour_policy(objective):
    from stppo_agent.training.scoring import score_batch

    t = scoring_inputs(algorithm={"kl_in_reward": 0.2}, rollout=dict(stale_objective=objective, staleness=1),
                       optimizer=dict(micro_batch_size=2))
    batch = make_batch()
    behaviour = t["generator"] if objective == "coupled" else t["actor"]
    old, ref, values, adv, ret = expected_scores(t, batch, behaviour, sampler=t["generator"])
    batch.old_logprobs = batch.ref_logprobs = batch.values = batch.advantages = batch.returns = None
    score_batch(batch, **t)
    mask = batch.loss_mask
    assert torch.allclose(batch.old_logprobs[mask], old[mask], atol=1e-5)
    assert torch.allclose(batch.ref_logprobs[mask], ref[mask], atol=1e-5)
    assert torch.allclose(batch.values[mask], values[mask], atol=1e-5)
    # the reward's KL is the sampling (lagged) policy's under both objectives; the behaviour weight of decoupled
    # goes to the loss as token_weights, not into the advantages
    assert torch.allclose(batch.advantages[mask], adv[mask], atol=1e-4)
    assert (batch.token_weights is None) == (objective == "coupled")
    assert torch.allclose(batch.returns[mask], ret[mask], atol=1e-4)
    assert batch.stats["advantage/mean"] == pytest.approx(float(adv[mask].mean()), abs=1e-5)
    assert batch.stats["advantage/std"] == pytest.approx(float(adv[mask].std()), rel=1e-4)
    sampled = expected_scores(t, batch, t["generator"])[0]  # kl_to_reference: the lagged policy's, both ways
    assert batch.stats["kl_to_reference"] == pytest.approx(float((sampled - ref)[mask].mean()), abs=1e-5)


def test_scoring_without_critic_or_reference():
    from stppo_agent.training.scoring import score_batch

    t = scoring_inputs("grpo", reference=False, critic=False, algorithm={"kl_loss_coef": 0.0, "kl_in_reward": 0.0},
                       rollout=dict(samples_per_prompt=2))
    batch = make_batch()
    batch.ref_logprobs = batch.values = None
    _, _, _, adv, _ = expected_scores(t, batch, t["generator"])
    score_batch(batch, **t)
    assert batch.ref_logprobs is None and batch.values is None and "kl_to_reference" not in batch.stats
    assert torch.allclose(batch.advantages, adv, atol=1e-5)


def test_scoring_whitens_over_the_global_batch_with_several_ranks(monkeypatch):
    import stppo_agent.training.scoring as scoring

    whitened = []
    monkeypatch.setattr(scoring.process_group, "distributed_whiten",
                        lambda x, mask: whitened.append(x.clone()) or x * 0 + 7.0)
    t = scoring_inputs(reference=False)
    t["world"] = 2
    batch = make_batch()
    scoring.score_batch(batch, **t)
    assert len(whitened) == 1 and (batch.advantages == 7.0).all()
    raw = dataclasses_replace(t["algo"], whiten_advantages=False)
    t["world"], t["algo"] = 1, raw
    again = make_batch()
    scoring.score_batch(again, **t)
    assert torch.allclose(whitened[0], again.advantages, atol=1e-5)  # the local estimate, not whitened locally


def test_scoring_hands_the_rollout_correction_weights_to_the_loss():
    from stppo_agent.training.scoring import score_batch

    t = scoring_inputs(reference=False, algorithm={"rollout_correction": "tis", "rollout_correction_level": "token"})
    batch = make_batch()
    batch.sample_logprobs = torch.full_like(batch.sample_logprobs, -2.0)
    plain = scoring_inputs(reference=False, algorithm={"rollout_correction": "none"})
    reference_batch = make_batch()
    reference_batch.sample_logprobs = batch.sample_logprobs.clone()
    score_batch(batch, **t)
    score_batch(reference_batch, **plain)
    assert "rollout_logprob_diff" in batch.stats
    mask = batch.loss_mask
    assert torch.allclose(batch.advantages[mask], reference_batch.advantages[mask], atol=1e-6)  # not folded in
    expected = torch.exp(batch.old_logprobs + 2.0).clamp(max=2.0)
    assert torch.allclose(batch.token_weights[mask], expected[mask], atol=1e-6) and not batch.token_weights[~mask].any()
    assert reference_batch.token_weights is None  # no correction: every weight 1


def test_the_sft_forward_gets_the_mask_positions_and_no_cache():
    from stppo_agent.training.log_probs import position_ids
    from stppo_agent.training.sft import action_logprobs

    seen = {}
    inner = tiny_lm().eval()

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None,
                    output_hidden_states=None, logits_to_keep=0):
            seen.update(attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
                        logits_to_keep=logits_to_keep)
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep)

        def get_output_embeddings(self):
            return inner.get_output_embeddings()

    batch = make_batch()
    with torch.no_grad():
        action_logprobs(Recorder(), batch)
    assert seen["attention_mask"] is batch.attention_mask and seen["use_cache"] is False
    assert torch.equal(seen["position_ids"], position_ids(batch.attention_mask)) and seen["logits_to_keep"] == 1


def test_sft_draws_its_order_from_the_seed(monkeypatch, tmp_path):
    transcripts = [[TRANSCRIPT[0], {"role": "assistant", "text": word, "turn": 0}]
                   for word in ("red", "green", "blue", "gold", "ok")]

    def order(seed, name):
        _, batches, _, _ = sft_run(monkeypatch, tmp_path / name, transcripts, steps=2, batch_size=2, seed=seed)
        return [ids for b in batches for ids in b.response_ids.tolist()]

    first = order(1, "a")
    assert order(1, "b") == first and order(2, "c") != first


def test_ddp_all_reduces_once_per_optimizer_step():
    import contextlib


    class DDPLike(torch.nn.Module):
        def __init__(self, module, log):
            super().__init__()
            self.module, self.log = module, log

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        @contextlib.contextmanager
        def no_sync(self):
            self.log.append("no_sync")
            yield

    actor_log, critic_log = [], []
    t = update_stage(optimizer=dict(micro_batch_size=1))
    t.state.actor_train, t.state.critic_train = DDPLike(t.state.actor, actor_log), DDPLike(t.state.critic, critic_log)
    t._optimizer_step(make_batch().select([0, 1, 2, 3]))
    assert actor_log == ["no_sync"] * 3 and critic_log == ["no_sync"] * 3  # all but the last of 4 micro-batches


def test_every_process_must_divide_both_batch_sizes(tiny_folder, tmp_path, monkeypatch):
    from stppo_agent.distributed import process_group
    from stppo_agent.training.trainer import Trainer

    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    for prompts, mini in ((3, 2), (2, 3)):  # either one indivisible is refused
        with pytest.raises(ValueError) as info:
            Trainer(toy_run(tiny_folder, tmp_path / "run",
                            rollout=dict(prompts_per_iteration=prompts, samples_per_prompt=2 if prompts == 3 else 3),
                            optimizer=dict(mini_batch_size=mini, micro_batch_size=1)))
        assert str(info.value) == (f"rollout.prompts_per_iteration ({prompts}) and optimizer.mini_batch_size ({mini}) "
                                   "must be multiples of the number of processes (2)")
    assert not (tmp_path / "run").exists()


def test_fsdp2_joins_the_process_group_before_anything_else(tiny_folder, tmp_path, monkeypatch):
    from stppo_agent.distributed import process_group
    from stppo_agent.training.trainer import Trainer

    def joined():
        raise RuntimeError("joined the process group")

    monkeypatch.setattr(process_group, "ensure_process_group", joined)
    with pytest.raises(RuntimeError, match="joined the process group"):
        Trainer(toy_run(tiny_folder, tmp_path / "run", distributed=dict(strategy="fsdp2")))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_only_a_later_rank_reseeds_and_only_the_first_writes_the_run(tiny_folder, tmp_path, monkeypatch, rank):
    """Rank 0 keeps the one-process stream (seeded once, before the models are built); a later rank then reseeds
    with its own seed, and neither logs, writes config.yaml nor saves a checkpoint (rank 0 does)."""
    from stppo_agent.distributed import process_group
    from stppo_agent.training.trainer import Trainer

    seeds, seed_everything = [], process_group.seed_everything
    monkeypatch.setattr(process_group, "seed_everything", lambda seed: seeds.append(seed) or seed_everything(seed))
    monkeypatch.setattr(process_group, "rank", lambda: rank)
    trainer = Trainer(toy_run(tiny_folder, tmp_path, iterations=1, checkpoint=dict(every=1),
                              monitor=dict(on_collapse="none")),
                      report=lambda _: None)
    assert seeds == ([11] if rank == 0 else [11, process_group.rank_seed(11, 1)])
    assert trainer._bar is None and trainer.phase("rollout") is None  # no bar outside train(): phases show nowhere
    assert trainer.rank == rank and (trainer.logger is None) == (rank == 1)
    trainer.train()
    assert (tmp_path / "config.yaml").exists() == (rank == 0) == (tmp_path / "metrics.jsonl").exists()
    assert trainer.save() == tmp_path / "checkpoints" / "step-1"
    assert (tmp_path / "checkpoints" / "step-1").is_dir() == (rank == 0)


def test_the_folder_and_the_metrics_log_report_through_the_trainer(tiny_folder, tmp_path):
    from stppo_agent.training.trainer import Trainer

    Trainer(toy_run(tiny_folder, tmp_path, iterations=1, checkpoint=dict(every=1), monitor=dict(on_collapse="none")),
            report=lambda _: None).train()
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 2, "rew')  # a torn last record, as kill -9 during a write leaves
    reports = []
    Trainer(toy_run(tiny_folder, tmp_path, iterations=1, checkpoint=dict(every=1), monitor=dict(on_collapse="none")),
            resume=True,
            report=reports.append)
    assert reports[-1] == f"{tmp_path / 'metrics.jsonl'}: dropped a torn last record (line 2, an interrupted write)"
    assert reports[0].startswith(f"resumed from {tmp_path / 'checkpoints' / 'step-1'} (iteration 1")
    reports.clear()
    Trainer(toy_run(tiny_folder, tmp_path, iterations=1, monitor=dict(on_collapse="none")), overwrite=True,
            report=reports.append)
    assert len(reports) == 1 and reports[0].startswith(f"--overwrite: removing the run in {tmp_path} (")


def test_a_resume_loads_the_checkpointed_weights_and_refuses_a_tied_setting(tiny_folder, tmp_path, monkeypatch):
    import stppo_agent.training.trainer as trainer_module
    from stppo_agent.training.trainer import Trainer

    first = Trainer(toy_run(tiny_folder, tmp_path, iterations=1, checkpoint=dict(every=1),
                            monitor=dict(on_collapse="none"), optimizer=dict(actor_lr=0.5)),
                    report=lambda _: None)
    first.train()
    again = Trainer(toy_run(tiny_folder, tmp_path, iterations=1, monitor=dict(on_collapse="none"),
                            optimizer=dict(actor_lr=0.5)), resume=True,
                    report=lambda _: None)
    trained, resumed = first.state.actor.state_dict(), again.state.actor.state_dict()
    assert all(torch.equal(trained[k], resumed[k]) for k in trained)  # not the folder's initial weights
    assert not (tmp_path / "rollouts").exists() and again.recorder is None  # save_rollouts is off
    loaded = []
    monkeypatch.setattr(trainer_module, "build_state", lambda *args: loaded.append(args))
    with pytest.raises(ValueError, match=r"^--resume cannot change seed \(11 -> 12\)"):  # before the models load
        Trainer(toy_run(tiny_folder, tmp_path, iterations=2, seed=12, monitor=dict(on_collapse="none"),
                        optimizer=dict(actor_lr=0.5)),
                resume=True, report=lambda _: None)
    assert loaded == []


class RecordedBar:
    """A tqdm bar that records what it is told (see :func:`record_bars`)."""

    def __init__(self, iterable=None, **kwargs):
        self.iterable, self.kwargs, self.disable = iterable, kwargs, kwargs.get("disable", False)
        self.updates, self.postfixes, self.phases, self.refreshed, self.closed = [], [], [], [], False

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n):
        self.updates.append(n)

    def set_postfix(self, **values):
        self.postfixes.append(values)

    def set_postfix_str(self, text, refresh):
        self.phases.append(text)
        self.refreshed.append(refresh)

    def close(self):
        self.closed = True


def record_bars(monkeypatch, desc: str) -> list[RecordedBar]:
    """The bars named ``desc`` that ``tqdm.auto.tqdm`` makes from now on, recorded; transformers' loading bars go
    on through the real one."""
    import tqdm.auto

    bars, real = [], tqdm.auto.tqdm

    def make(*args, **kwargs):
        if kwargs.get("desc") != desc:
            return real(*args, **kwargs)
        bars.append(RecordedBar(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(tqdm.auto, "tqdm", make)
    return bars


def test_the_training_bar_counts_iterations_from_where_the_run_stands(tiny_folder, tmp_path, monkeypatch):
    import time

    from stppo_agent.training.trainer import Trainer

    bars = record_bars(monkeypatch, "training")

    Trainer(toy_run(tiny_folder, tmp_path, iterations=1, checkpoint=dict(every=1), monitor=dict(on_collapse="none")),
            report=lambda _: None).train()
    assert bars[0].kwargs == dict(total=1, initial=0, desc="training", unit="it", disable=True)  # progress=False
    started = time.perf_counter()
    metrics = Trainer(toy_run(tiny_folder, tmp_path, iterations=3, monitor=dict(on_collapse="none"),
                              logging=dict(progress=True)), resume=True,
                      report=lambda _: None).train()
    elapsed = time.perf_counter() - started
    bar = bars[1]
    assert bar.kwargs == dict(total=3, initial=1, desc="training", unit="it", disable=False) and bar.closed
    assert bar.updates == [1, 1]
    assert [phase for phase in bar.phases if phase in ("rollout", "scoring")] == ["rollout", "scoring"] * 2
    assert bar.postfixes[-1] == {"reward": f"{metrics['reward']:.3f}",
                                 "tok_s": f"{metrics['update_tokens_per_s']:.0f}"}
    assert 0 < metrics["rollout_seconds"] <= metrics["iteration_seconds"] < elapsed


def scripted_guard(trainer, script: dict):
    """The run's guard, deciding ``script[iteration]`` (continue otherwise); its calls are kept in ``seen``."""
    from stppo_agent.monitoring.collapse_guard import CONTINUE, CollapseGuard

    guard = CollapseGuard(trainer.config, trainer.run_dir)
    seen = []

    def check(iteration, metrics, actor_lr_scale=1.0):
        seen.append((iteration, "reward" in metrics, actor_lr_scale))
        return script.get(iteration, CONTINUE)

    guard.check = check
    trainer.guard = guard
    return seen


def test_a_stop_decision_saves_then_stops_with_the_guards_advice(tiny_folder, tmp_path):
    from stppo_agent.monitoring.collapse_guard import CollapseStopped, Decision
    from stppo_agent.training.trainer import Trainer

    trainer = Trainer(toy_run(tiny_folder, tmp_path, iterations=3, checkpoint=dict(every=10),
                              monitor=dict(on_collapse="none")),
                      report=lambda _: None)
    checks = scripted_guard(trainer, {2: Decision("stop", "reward collapsed.")})
    with pytest.raises(CollapseStopped) as info:
        trainer.train()
    assert checks == [(1, True, 1.0), (2, True, 1.0)]
    assert str(info.value) == ("reward collapsed. The state at the alarm is saved in "
                               f"{tmp_path / 'checkpoints' / 'step-2'}.")
    assert (tmp_path / "checkpoints" / "step-2").is_dir()


def test_a_rollback_starts_a_new_streak_of_nan_skips(tiny_folder, tmp_path):
    """max_nan_skips counts consecutive skipped updates of one set of weights: skips before a rollback belong to
    the weights it abandoned, so they do not bring the restored run nearer to stopping."""
    from stppo_agent.training.trainer import Trainer

    trainer = Trainer(toy_run(tiny_folder, tmp_path, iterations=2, checkpoint=dict(every=1),
                              monitor=dict(on_collapse="none")),
                      report=lambda message: None)
    trainer.train()
    trainer.state.nan_skips_in_a_row, total = 3, trainer.state.nan_skips_total
    trainer.roll_back(1)
    assert trainer.state.nan_skips_in_a_row == 0 and trainer.state.nan_skips_total == total  # the total is history


def test_only_the_main_process_says_the_guards_alarm(tiny_folder, tmp_path, monkeypatch):
    """Every rank reaches the same decision (the monitor reads globally reduced metrics); one line says it, not
    one per process."""
    from stppo_agent.distributed import process_group
    from stppo_agent.monitoring.collapse_guard import Decision
    from stppo_agent.training.trainer import Trainer

    said = {}
    for main in (True, False):
        monkeypatch.setattr(process_group, "is_main", lambda main=main: main)
        reports = said[main] = []
        trainer = Trainer(toy_run(tiny_folder, tmp_path / str(main), iterations=2, checkpoint=dict(every=10),
                                  monitor=dict(on_collapse="none")),
                          report=reports.append)
        scripted_guard(trainer, {2: Decision("warn", "looks odd.")})
        trainer.train()
    assert "looks odd." in said[True] and "looks odd." not in said[False]


def test_the_loop_carries_out_every_decision_of_the_guard(tiny_folder, tmp_path):
    """continue: nothing; warn: say it and checkpoint; rollback to step N: step-N's weights and optimizer state at
    a lowered learning rate, said, logged and checkpointed; stop: checkpoint, then stop."""
    from safetensors.torch import load_file

    from stppo_agent.monitoring.collapse_guard import CollapseStopped, Decision
    from stppo_agent.runs.checkpoint import load_trainer_state
    from stppo_agent.runs.metrics_log import read_metrics
    from stppo_agent.training.trainer import Trainer

    reports = []
    trainer = Trainer(toy_run(tiny_folder, tmp_path, iterations=6, checkpoint=dict(every=10),
                              monitor=dict(on_collapse="none"), optimizer=dict(actor_lr=0.01)),
                      report=reports.append)
    seen = scripted_guard(trainer, {2: Decision("warn", "looks odd."),
                                    3: Decision("rollback", "collapsed.", rollback_to=2),
                                    5: Decision("stop", "collapsed again.")})
    synced = []  # what an engine with its own copy of the weights (vLLM) was handed, as it was then
    sync = trainer.backend.sync_weights

    def sync_weights(actor):
        synced.append((actor, {name: p.detach().clone() for name, p in actor.named_parameters()}))
        sync(actor)

    trainer.backend.sync_weights = sync_weights
    with pytest.raises(CollapseStopped) as info:
        trainer.train()
    assert [actor for actor, _ in synced] == [trainer.state.actor] * 6  # after each of the 5 updates, the rollback
    folder = tmp_path / "checkpoints"
    # the 4th hand-over is the rollback's (iteration 3, after its update's): step-2's weights, not the collapsed ones
    restored = load_file(folder / "step-2" / "actor" / "model.safetensors")
    handed = [weights for _, weights in synced]
    assert restored.keys() <= handed[3].keys() and all(torch.equal(handed[3][k], restored[k]) for k in restored)
    assert not all(torch.equal(handed[2][k], restored[k]) for k in restored)  # the update had moved them
    final = dict(trainer.state.actor.named_parameters())
    assert all(torch.equal(handed[-1][k], final[k]) for k in final)  # the engine ends in step with the actor
    assert str(info.value) == f"collapsed again. The state at the alarm is saved in {folder / 'step-5'}."
    assert seen == [(1, True, 1.0), (2, True, 1.0), (3, True, 1.0), (4, True, 0.5), (5, True, 0.5)]
    assert [m for m in reports if not m.startswith("iteration ")] == ["looks odd.", "collapsed.", "collapsed again."]
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-3", "step-5"]  # each alarm, at once
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and trainer.state.iteration == 5
    assert not any("collapse/rollback_to" in r for r in records if r["step"] != 3)
    rolled = records[2]
    assert (rolled["collapse/rollback_to"], rolled["collapse/lr_scale"]) == (2, 0.5)
    assert rolled["collapse/actor_lr"] == pytest.approx(0.005) == trainer.state.actor_scheduler.get_last_lr()[0]
    assert [r["actor_lr"] for r in records] == [pytest.approx(x) for x in (0.01, 0.01, 0.01, 0.005, 0.005)]
    assert trainer.guard.rollbacks == 1 and trainer.state.actor_lr_scale == 0.5
    # step-3 is the state the rollback restored, saved at once: step-2's weights and optimizer moments
    two, three = load_file(folder / "step-2" / "actor" / "model.safetensors"), \
        load_file(folder / "step-3" / "actor" / "model.safetensors")
    assert two.keys() == three.keys() and all(torch.equal(two[k], three[k]) for k in two)
    (two, saved_two), (three, saved_three) = (load_trainer_state(folder / f"step-{n}") for n in (2, 3))
    moments = two["actor_optimizer"]["state"]
    assert moments and all(torch.equal(moments[name][key], three["actor_optimizer"]["state"][name][key])
                           for name in moments for key in ("exp_avg", "exp_avg_sq"))
    assert (saved_two["iteration"], saved_three["iteration"]) == (2, 3)  # iterations keep counting
    assert saved_three["actor_lr_scale"] == 0.5 and saved_two["actor_lr_scale"] == 1.0
    # the collapsed update's steps count: the policy version is not rolled back
    assert saved_three["optimizer_steps"] == saved_two["optimizer_steps"] + trainer.config.optimizer.epochs


def test_save_hands_the_gathered_states_and_the_protected_steps(monkeypatch, tmp_path):
    import stppo_agent.training.state as state_module

    from .training_states import linear_state

    saved = []
    monkeypatch.setattr(state_module, "save_checkpoint", lambda run_dir, iteration, **kw: saved.append(
        (run_dir, iteration, kw)) or run_dir / "saved")
    monkeypatch.setattr(state_module.TrainingState, "states", lambda self, config, algo: ("tensors", "json"))
    state = linear_state(iteration=7)
    state.tokenizer, state.critic = "tok", torch.nn.Linear(1, 1)
    gathered = {id(state.actor): "full actor", id(state.critic): "full critic"}
    monkeypatch.setattr(state_module, "full_model_state", lambda model: gathered[id(model)])
    cfg = config(checkpoint=dict(keep=3))
    assert state.save(tmp_path, cfg, cfg.algorithm_config(), sharded=True, protect=(2, 4)) == tmp_path / "saved"
    assert saved == [(tmp_path, 7, dict(actor=state.actor, tokenizer="tok", critic=state.critic,
                                        tensor_state="tensors", json_state="json", keep=3, actor_state="full actor",
                                        critic_state="full critic", protect=(2, 4)))]
    state.critic = None
    assert state.full_states(True) == ("full actor", None)
    state.save(tmp_path, cfg, cfg.algorithm_config(), sharded=True)
    assert saved[-1][2]["protect"] == () and saved[-1][2]["critic_state"] is None
    assert state.full_states(False) == (None, None)


def test_train_on_cuda_measures_each_iterations_peak_memory(tiny_folder, tmp_path, monkeypatch):
    """The CUDA-only lines, on a trainer whose device says cuda: this CPU has no device to measure."""
    import stppo_agent.training.trainer as trainer_module
    from stppo_agent.training.trainer import Trainer

    trainer = Trainer(toy_run(tiny_folder, tmp_path, iterations=2, checkpoint=dict(every=10),
                              monitor=dict(on_collapse="none")),
                      report=lambda _: None)
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: calls.append(("peak", device)) or 3 * 2**29)
    monkeypatch.setattr(trainer_module, "rollout_statistics",
                        lambda batch, algo: calls.append(("statistics", algo)) or {"reward": 0.5})
    device = SimpleNamespace(type="cuda")
    trainer.device = device
    trainer.rollout = lambda: SimpleNamespace(loss_mask=torch.ones(2, 3), batch_size=2)
    trainer.score = lambda batch, old_from_update=False: None
    trainer.update = lambda batch: {"update_tokens_per_s": 10.0}
    trainer.save = lambda: calls.append("save") or "path"
    metrics = trainer.train()
    assert calls == [("reset", device), ("statistics", trainer.algo), ("peak", device)] * 2 + ["save"]
    assert metrics["gpu_peak_memory_gib"] == 1.5 and trainer.state.iteration == 2


def test_an_action_is_tokenised_without_the_special_tokens_a_prompt_gets():
    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.training.sft import trajectory_from_transcript

    words = word_tokenizer()

    def with_bos(text, add_special_tokens=True):  # a tokenizer that adds BOS (SmolLM2's and Qwen's do not; Llama's do)
        return {"input_ids": [1] * add_special_tokens + words(text, add_special_tokens=False)["input_ids"]}

    t = trajectory_from_transcript(with_bos, TRANSCRIPT, 4)
    assert t.prompt_ids[0] == 1 and 1 not in t.response_ids


def test_the_sft_loss_reads_the_last_hidden_state_of_a_deeper_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from stppo_agent.training.log_probs import token_logprobs
    from stppo_agent.training.sft import action_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                         pad_token_id=0, bos_token_id=None, eos_token_id=1)).eval()
    batch = make_batch()
    with torch.no_grad():
        assert torch.allclose(action_logprobs(model, batch), token_logprobs(model, batch)[0][batch.loss_mask],
                              atol=1e-5)


def test_sft_hands_its_settings_to_every_step(monkeypatch, tmp_path):
    """The model and tokenizer path, the config to the teacher, the observation cut, the length boundary, the
    autocast dtype, the gradient clip, the bar and the time measured: what one short run hands each step."""
    import time

    import stppo_agent.training.sft as sft
    from stppo_agent.models.tiny import word_tokenizer

    seen = {"clip": []}
    transcripts = [[TRANSCRIPT[0], {"role": "assistant", "text": "red", "turn": 0},
                    {"role": "env", "text": "green blue gold red", "turn": 0},
                    {"role": "assistant", "text": "gold", "turn": 1}]]
    monkeypatch.setattr(sft, "demonstrations", lambda config: seen.update(teacher_config=config) or transcripts)
    monkeypatch.setattr(sft, "load_tokenizer", lambda path: seen.update(tokenizer=path) or word_tokenizer())
    monkeypatch.setattr(sft, "load_actor", lambda path, dtype: tiny_lm(2))
    autocast_forward = sft.autocast_forward
    monkeypatch.setattr(sft, "autocast_forward", lambda model, dtype: seen.update(autocast=dtype) or
                        autocast_forward(model, dtype))
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, norm: seen["clip"].append(norm) or
                        clip(params, norm))
    batches, to_batch = [], sft.to_batch
    monkeypatch.setattr(sft, "to_batch", lambda trajectories, pad: batches.append(to_batch(trajectories, pad)) or
                        batches[-1])
    bars = record_bars(monkeypatch, "warm start")
    prompt = len(word_tokenizer()("say red")["input_ids"])
    cfg = sft.SFTConfig(model="the/model", output_dir=str(tmp_path / "out"), device="cpu", steps=1, batch_size=1,
                        max_observation_tokens=1, max_total_tokens=prompt + 3, autocast_dtype="bfloat16", seed=5)
    started = time.perf_counter()
    summary = sft.train_sft(cfg, report=lambda _: None)  # steps=1, a one-token observation: the smallest allowed
    elapsed = time.perf_counter() - started
    assert seen["tokenizer"] == "the/model" and seen["teacher_config"].seed == 5
    assert seen["autocast"] == "bfloat16" and seen["clip"] == [1.0]
    assert batches[0].response_ids.shape[1] == 3  # red, green (the observation cut to 1), gold: exactly the limit
    bar, = bars
    assert bar.kwargs == {"desc": "warm start", "unit": "step", "disable": False} and bar.closed
    assert bar.postfixes == [{"loss": f"{summary['last_loss']:.3f}", "refresh": False}]
    assert 0 < summary["seconds"] < elapsed
    assert summary["config"]["autocast_dtype"] == "bfloat16" and summary["demonstrations"] == 1


def test_the_off_policy_means_leave_out_the_first_step_alone():

    t = update_stage(seed=3, optimizer=dict(epochs=2, mini_batch_size=4, micro_batch_size=2),
                     logging=dict(step_diagnostics=True))
    updater, steps = t, []
    step = updater._optimizer_step
    updater._optimizer_step = lambda mini: steps.append(step(mini)) or steps[-1]
    metrics = updater.update(make_batch())
    assert len(steps) == 4 and metrics["offpolicy/steps"] == 3.0
    for key in ("clip_frac", "clip_bias_norm"):
        assert len({s[key] for s in steps}) > 1  # the steps differ, so which one is left out shows
        assert metrics[f"offpolicy/{key}"] == pytest.approx(sum(s[key] for s in steps[1:]) / 3, rel=1e-9)
        assert metrics[key] == pytest.approx(sum(s[key] for s in steps) / 4, rel=1e-9)


def test_with_two_processes_the_update_gathers_the_global_batch_and_takes_its_rows(monkeypatch):
    import stppo_agent.training.ppo_update as ppo_update

    t = update_stage(critic=False, optimizer=dict(mini_batch_size=4, micro_batch_size=2))
    t.world, t.rank, t.state.tokenizer = 2, 1, SimpleNamespace(pad_token_id=7)
    calls, rows, real_rows = [], [], ppo_update.mini_batch_rows
    monkeypatch.setattr(ppo_update, "gather_global_batch", lambda batch, pad: calls.append(pad) or batch)
    monkeypatch.setattr(ppo_update, "mini_batch_rows", lambda order, start, size, rank, world: rows.append(
        (start, size, rank, world)) or real_rows(order, start, size, rank, world))
    monkeypatch.setattr(ppo_update.process_group, "all_reduce_sum", lambda value: value * 2)  # two equal ranks
    t.update(make_batch())
    assert calls == [7] and rows == [(0, 4, 1, 2), (4, 4, 1, 2)] and t.state.optimizer_steps == 2
    mini = make_batch().select([0, 1, 2])
    tokens, seqs = t._global_counts(mini)  # global counts / world: DDP averages gradients
    assert float(tokens) == float(mini.loss_mask.sum()) and float(seqs) == float(mini.loss_mask.any(1).sum())


@pytest.mark.parametrize("sharded", [True, False])
def test_the_clip_bias_corrector_gets_the_algorithms_settings_and_an_anchor(monkeypatch, sharded):
    import stppo_agent.training.ppo_update as ppo_update

    made, anchors = [], []

    class Corrector:
        def __init__(self, params, kappa=1.0, through_grad=False, rescale=True):
            made.append((len(params), kappa, through_grad, rescale))

        def accumulate(self, bias, anchor=None):
            anchors.append(anchor)

        def all_reduce(self):
            pass

        def measure(self):
            return {}

    monkeypatch.setattr(ppo_update, "ClipBiasCorrector", Corrector)
    t = update_stage("s_ppo", algorithm={"clip_bias_kappa": 2.5}, optimizer=dict(micro_batch_size=2))
    t.sharded = sharded
    t.actor_gradients(make_batch().select([0, 1, 2, 3]))
    params = len([p for p in t.state.actor.parameters() if p.requires_grad])
    assert made == [(params, 2.5, sharded, True)]
    assert len(anchors) == 2 and all(isinstance(a, torch.Tensor) and a.requires_grad for a in anchors)
    made.clear()
    update_stage("ppo", logging=dict(step_diagnostics=True)).actor_gradients(make_batch().select([0, 1]))
    assert made[0][1:] == (1.0, False, False)  # measured only: no rescaling


def test_a_registered_losss_own_metrics_are_weighted_by_policy_tokens(monkeypatch):
    from stppo_agent.algorithms import get_policy_loss, register_policy_loss

    ppo_clip = get_policy_loss("ppo_clip")

    def plain(**kwargs):
        loss, bias, metrics = ppo_clip(**kwargs)
        return loss, bias, {"micro_tokens": float(kwargs["loss_mask"].sum())}  # no parts: a plain number

    register_policy_loss("pins_plain_metrics", plain)
    t = update_stage("ppo", algorithm={"policy_loss": "pins_plain_metrics"}, optimizer=dict(micro_batch_size=1))
    mini = make_batch().select([0, 2, 3])
    tokens = [float(row.sum()) for row in mini.loss_mask]
    out = t.actor_gradients(mini)
    assert len(set(tokens)) > 1
    assert out["micro_tokens"] == pytest.approx(sum(n * n for n in tokens) / sum(tokens))


@pytest.mark.parametrize("broken", ["gradient", "another rank"])
def test_a_step_is_skipped_on_an_infinite_gradient_or_another_ranks_bad_loss(monkeypatch, broken):
    import stppo_agent.training.ppo_update as ppo_update

    t = update_stage(critic=False)
    if broken == "gradient":  # finite losses, an overflowing gradient
        monkeypatch.setattr(ppo_update.process_group, "clip_grad_norm", lambda params, norm: torch.tensor(math.inf))
    else:  # this rank's loss is finite, the all-reduced count of finite ranks is not the world
        monkeypatch.setattr(ppo_update.process_group, "all_reduce_sum", lambda value: value * 0)
    out = t._optimizer_step(make_batch().select([0, 1, 2, 3]))
    assert math.isnan(out["grad_norm"]) and out["skipped"] == 1.0 and t.state.optimizer_steps == 0


def test_the_whole_batch_statistic_scores_under_the_sampling_settings(monkeypatch):
    import stppo_agent.training.ppo_update as ppo_update
    from stppo_agent.training.log_probs import token_logprobs

    t = update_stage("m2po", critic=False, optimizer=dict(micro_batch_size=2), rollout=dict(temperature=0.7))
    seen = []

    def statistic(logprobs, old_logprobs, loss_mask, turn_ids, config):
        seen.append(logprobs)
        return [{} for _ in logprobs]

    monkeypatch.setattr(ppo_update, "WHOLE_BATCH_STATISTICS", {t.algo.policy_loss: statistic})
    updater = t
    micros = [micro for _, micro in updater._split(make_batch().select([0, 1, 2, 3]))]
    assert updater._whole_batch_keywords(micros) == [{}, {}]
    with torch.no_grad():
        for got, micro in zip(seen[0], micros):
            want = token_logprobs(t.state.actor, micro, sampling=t.config.sampling())[0]
            assert torch.allclose(got, want) and not torch.allclose(got, token_logprobs(t.state.actor, micro)[0])


def test_sft_resolves_auto_precision_for_its_device(monkeypatch, tmp_path):
    from stppo_agent.models.precision import resolve_autocast_dtype

    transcripts = [[TRANSCRIPT[0], {"role": "assistant", "text": "red", "turn": 0}]]
    summary, *_ = sft_run(monkeypatch, tmp_path, transcripts, steps=1, batch_size=1, autocast_dtype="auto")
    assert summary["config"]["autocast_dtype"] == resolve_autocast_dtype("auto", torch.device("cpu"))
    assert summary["config"]["autocast_dtype"] != "auto"
