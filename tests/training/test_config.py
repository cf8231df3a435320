"""``stppo_agent.training.config``: defaults, validation and its messages, numbers in
every common spelling, merging files, flags and overrides, and settings that cannot learn refused."""

from __future__ import annotations

import re
import typing

import pytest
import yaml

from stppo_agent.cli import main
from stppo_agent.training.config import TrainConfig, _coerce, from_dict, load_config, merged
from stppo_agent.training.config_sections import DistributedConfig, OptimizerConfig, PrecisionConfig, RolloutConfig
from tests.support.training_parts import config


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


# Config parsing: numbers in every common spelling, clear errors, and settings that cannot learn refused.


@pytest.mark.parametrize("raw, value", [("1e-6", 1e-6), ("1E-6", 1e-6), ("1e+3", 1000.0), ("2.5e-3", 2.5e-3),
                                        (".5", 0.5), ("5.", 5.0), ("-1e-2", -0.01), ("3", 3.0), ("0.001", 0.001)])
def test_numbers_parse_in_every_common_spelling(raw, value, tmp_path):
    config = load_config(None, [f"optimizer.actor_lr={raw}", f"algorithm.kl_in_reward={raw}", "model=m"])
    assert config.optimizer.actor_lr == value and isinstance(config.optimizer.actor_lr, float)
    assert config.algorithm_config().kl_in_reward == value
    path = tmp_path / "run.yaml"
    path.write_text(f"optimizer:\n  actor_lr: {raw}\nalgorithm:\n  entropy_coef: {raw}\n")
    from_file = load_config(path, [], model="m")
    assert from_file.optimizer.actor_lr == value and from_file.algorithm_config().entropy_coef == value


def test_strings_stay_strings():
    config = load_config(None, ["model=1e-6-model", "env=stppo/NQ-v0", "algorithm.kl_estimator=k3", "seed=7"])
    assert config.model == "1e-6-model" and config.seed == 7 and isinstance(config.seed, int)


@pytest.mark.parametrize("item, message", [("algorithm.clip_high=abc", "algorithm.clip_high expects float"),
                                           ("optimizer.actor_lr=fast", "actor_lr expects float"),
                                           ("iterations=1.5", "iterations expects int"),
                                           ("no_such_field=1", "unknown key 'no_such_field'"),
                                           ("algorithm.no_such=1", "unknown algorithm fields"),
                                           ("actor_lr", "expects key=value"),
                                           ("optimizer.actor_lr=[1", "not valid YAML")])
def test_bad_values_get_a_message_naming_the_field(item, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [item, "model=m"]).validate()


def test_a_broken_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("optimizer:\n  actor_lr: [1e-6\n")
    with pytest.raises(ValueError, match="broken.yaml is not valid YAML"):
        load_config(path, [])


@pytest.mark.parametrize("algo", ["grpo", "gspo", "so_grpo"])
def test_group_algorithms_refuse_groups_of_one(algo):
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        TrainConfig(algo=algo, model="m", rollout=RolloutConfig(samples_per_prompt=1)).validate()
    TrainConfig(algo=algo, model="m", rollout=RolloutConfig(samples_per_prompt=2),
                optimizer=OptimizerConfig(mini_batch_size=8, micro_batch_size=4)).validate()
    TrainConfig(algo="ppo", model="m", rollout=RolloutConfig(samples_per_prompt=1)).validate()  # GAE needs no group


def test_cli_reports_config_errors_without_a_traceback(capsys):
    assert main(["train", "--algo", "grpo", "--model", "m", "--output-dir", "/tmp/x"]) == 1
    assert "samples_per_prompt" in capsys.readouterr().err


PLUGIN = '''
import dataclasses
from stppo_agent.algorithms import ALGORITHMS, register_algorithm
register_algorithm(dataclasses.replace(ALGORITHMS["turn_ppo"], name="{name}", clip_high=0.31))
'''


def test_a_user_algorithm_is_chosen_from_the_cli_and_the_run_reproduces_from_its_folder(tmp_path, monkeypatch):
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
    from stppo_agent.runs.metrics_log import read_metrics

    (tmp_path / "my_algos.py").write_text(PLUGIN.format(name="my_algo"))
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    run = tmp_path / "run"
    common = ["--set", "rollout.prompts_per_iteration=2", "--set", "optimizer.mini_batch_size=2", "--set",
              "optimizer.micro_batch_size=2",
              "--set", "rollout.max_turns=2", "--set", "rollout.max_new_tokens_per_turn=1", "--set",
              "rollout.max_prompt_tokens=8",
              "--set", "rollout.max_total_tokens=32", "--set", "logging.progress=false", "--set", "checkpoint.every=1"]
    assert main(["train", "--algo", "my_algo", "--env", "stppo/Toy-v0", "--model", str(model), "--output-dir",
                 str(run), "--iterations", "1"] + common) == 1  # not imported: unknown
    assert main(["train", "--import", "my_algos", "--algo", "my_algo", "--env", "stppo/Toy-v0", "--model",
                 str(model), "--output-dir", str(run), "--iterations", "1"] + common) == 0
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["plugins"] == ["my_algos"] and saved["algo"] == "my_algo"
    assert saved["algorithm"]["clip_high"] == 0.31 and saved["algorithm"]["ratio_level"] == "turn"
    assert len(saved["algorithm"]) >= 15  # every resolved field, not only overrides
    # --resume reads the run's own config: no --algo, --model or --import needed
    assert main(["train", "--output-dir", str(run), "--resume", "--iterations", "2"]) == 0
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    # the resolved fields of one algorithm never leak into another chosen with --algo
    other = load_config(run / "config.yaml", [], algo="grpo", output_dir=str(tmp_path / "other"))
    assert other.algorithm_config().advantage == "grpo" and other.algorithm_config().ratio_level == "token"


NEEDS_FLOAT32 = ("precision.generation_autocast_dtype=bfloat16 samples in bfloat16 against a float32 learner: it "
                 "needs precision.dtype=float32 and neither precision.autocast_dtype nor precision.fsdp_compute_dtype")


def precision_config(**values) -> TrainConfig:
    return from_dict(merged({"model": "m", "env": "stppo/Toy-v0",
                             "precision": {"generation_autocast_dtype": "bfloat16"}}, values))


def refused_word_for_word(message: str, **values) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        precision_config(**values).validate()


def test_a_bfloat16_sampler_against_a_float32_ddp_or_fsdp2_learner_is_accepted():
    precision_config().validate()
    precision_config(distributed=dict(strategy="fsdp2")).validate()
    TrainConfig(model="m", env="stppo/Toy-v0",
                precision=PrecisionConfig(dtype="bfloat16")).validate()  # unset: no check of the learner


def test_the_sampler_dtype_and_backend_are_refused_word_for_word():
    refused_word_for_word("precision.generation_autocast_dtype must be bfloat16 (or unset), got 'float16'",
                          precision=dict(generation_autocast_dtype="float16"))
    refused_word_for_word(
        "precision.generation_autocast_dtype is for rollout.backend=hf (vLLM samples in its own dtype)",
        rollout=dict(backend="vllm"))


@pytest.mark.parametrize("learner", [
    {"precision": {"dtype": "bfloat16"}},
    {"precision": {"autocast_dtype": "bfloat16"}},
    {"distributed": {"strategy": "fsdp2"}, "precision": {"fsdp_compute_dtype": "bfloat16"}},
])
def test_each_learner_setting_that_is_not_float32_is_refused_alone(learner):
    refused_word_for_word(NEEDS_FLOAT32, **learner)


# Nonsensical optimizer and stop settings are refused.


@pytest.mark.parametrize("field, value, says", [
    # clipping to norm 0 zeroed every gradient: no learning; a negative clip coefficient ascended the loss
    ("optimizer.max_grad_norm", 0.0, "optimizer.max_grad_norm must be > 0"),
    ("optimizer.max_grad_norm", -1.0, "optimizer.max_grad_norm must be > 0"),
    # a negative rate stopped the run: "0% of searches failed"
    ("monitor.max_search_error_rate", -1.0, "monitor.max_search_error_rate must be in [0, 1]"),
    ("monitor.max_search_error_rate", 1.5, "monitor.max_search_error_rate must be in [0, 1]"),
    ("optimizer.actor_lr", -1e-3, "optimizer.actor_lr must be >= 0"),
    ("optimizer.critic_lr", -1e-3, "optimizer.critic_lr must be >= 0"),
    ("optimizer.weight_decay", -0.1, "optimizer.weight_decay must be >= 0"),
    ("optimizer.warmup_steps", -5, "optimizer.warmup_steps must be >= 0"),
    ("rollout.vllm_gpu_memory_utilization", 1.5, "rollout.vllm_gpu_memory_utilization must be in (0, 1]"),
])
def test_train_config_refuses_nonsensical_optimizer_and_stop_settings(field, value, says):
    from stppo_agent.training.config import TrainConfig

    section, _, key = field.partition(".")
    config = TrainConfig(algo="ppo", env="stppo/Toy-v0", model="tiny", output_dir="unused", **{section: {key: value}})
    with pytest.raises(ValueError, match=f"^{re.escape(says)}"):
        config.validate()
    TrainConfig(algo="ppo", env="stppo/Toy-v0", model="tiny", output_dir="unused").validate()


def test_config_layers_yaml_flags_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algo: grpo\niterations: 7\noptimizer:\n  actor_lr: 1\nalgorithm:\n  clip_high: 0.28\n")
    config = load_config(path, ["iterations=9", "algorithm.clip_low=0.1", "env_kwargs.topk=5"], model="m", algo=None)
    assert (config.algo, config.iterations, config.optimizer.actor_lr, config.model) == ("grpo", 9, 1.0, "m")
    algo = config.algorithm_config()
    assert (algo.clip_high, algo.clip_low, algo.advantage) == (0.28, 0.1, "grpo")
    assert config.env_kwargs == {"topk": 5}
    with pytest.raises(ValueError, match="unknown key 'lr'"):
        load_config(None, ["lr=3"])
    with pytest.raises(ValueError, match="unknown algorithm fields \\['clip'\\]"):
        load_config(None, ["algorithm.clip=3", "model=m"]).validate()
    with pytest.raises(ValueError, match="iterations expects int"):
        load_config(None, ["iterations=many"])
    with pytest.raises(ValueError, match="multiple of optimizer.micro_batch_size"):
        TrainConfig(model="m", optimizer=OptimizerConfig(mini_batch_size=6, micro_batch_size=4)).validate()
    with pytest.raises(KeyError, match="unknown algorithm 'stppo'"):
        TrainConfig(model="m", algo="stppo").validate()
    with pytest.raises(ValueError, match="strategy must be ddp or fsdp2"):
        TrainConfig(model="m", distributed=DistributedConfig(strategy="zero3")).validate()
    load_config(None, ["model=m", "distributed.strategy=fsdp2", "precision.fsdp_compute_dtype=bfloat16"]).validate()
    with pytest.raises(ValueError, match="precision.fsdp_compute_dtype needs distributed.strategy=fsdp2"):
        TrainConfig(model="m", precision=PrecisionConfig(fsdp_compute_dtype="bfloat16")).validate()
    with pytest.raises(ValueError, match="must be bfloat16 or float16"):
        TrainConfig(model="m", distributed=DistributedConfig(strategy="fsdp2"),
                    precision=PrecisionConfig(fsdp_compute_dtype="int8")).validate()
    saved = tmp_path / "saved.yaml"
    saved.write_text(config.to_yaml())
    assert load_config(saved) == config
