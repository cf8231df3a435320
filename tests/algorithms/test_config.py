"""``stppo_agent.algorithms.config``: the algorithm settings' defaults, their refusals and
boundaries, and each preset's difference from the defaults as docs/algorithms.md tabulates it."""

from __future__ import annotations

import dataclasses

import pytest

from stppo_agent.algorithms.config import ALGORITHMS, AlgorithmConfig, register_algorithm

DEFAULTS = {
    "name": "custom", "advantage": "gae", "policy_loss": "ppo_clip", "ratio_level": "token",
    "clip_bias_correction": False, "clip_bias_kappa": 1.0, "clip_bias_order": "before_grad_clip", "clip_low": 0.2,
    "clip_high": 0.2, "clip_ratio_c": None,
    "loss_agg": "token-mean", "loss_scale_factor": 1024.0, "tau_pos": 1.0, "tau_neg": 1.05, "is_cap": 20.0,
    "m2_threshold": 0.04, "dynamic_sampling": False, "max_resample_rounds": 10, "gamma": 1.0, "lam": 1.0,
    "whiten_advantages": True, "grpo_std_normalize": True, "use_critic": True, "value_clip": 0.5,
    "kl_in_reward": 0.0, "kl_loss_coef": 0.0, "kl_estimator": "low_var_kl", "entropy_coef": 0.0,
    "rollout_correction": "auto", "rollout_correction_level": "auto", "rollout_correction_cap": 2.0,
    "hyperparameters": (),
}
_GRPO_DIFF = {"advantage": "grpo", "use_critic": False, "kl_estimator": "k3"}
PRESETS = {  # each preset's fields that differ from the defaults (docs/algorithms.md, "Named algorithms")
    "ppo": {"kl_in_reward": 0.001},
    "turn_ppo": {"ratio_level": "turn", "kl_in_reward": 0.001},
    "s_ppo": {"clip_bias_correction": True, "kl_in_reward": 0.001},
    "st_ppo": {"ratio_level": "turn", "clip_bias_correction": True, "kl_in_reward": 0.001},
    "grpo": {**_GRPO_DIFF, "kl_loss_coef": 0.001},
    "gspo": {**_GRPO_DIFF, "ratio_level": "sequence", "clip_low": 3e-4, "clip_high": 4e-4,
             "loss_agg": "seq-mean-token-mean"},
    "so_grpo": {**_GRPO_DIFF, "ratio_level": "turn", "clip_bias_correction": True, "kl_loss_coef": 0.001},
    "turn_gae": {"advantage": "turn_gae", "ratio_level": "turn", "kl_in_reward": 0.001},
    "cispo": {**_GRPO_DIFF, "policy_loss": "cispo", "clip_low": 1.0},
    "sapo": {**_GRPO_DIFF, "policy_loss": "sapo", "loss_agg": "seq-mean-token-mean"},
    "gmpo": {**_GRPO_DIFF, "policy_loss": "gmpo", "ratio_level": "sequence", "clip_low": 0.4, "clip_high": 0.4,
             "loss_agg": "seq-mean-token-mean"},
    "dppo_tv": {**_GRPO_DIFF, "policy_loss": "dppo_tv", "clip_low": 0.15, "clip_high": 0.15, "is_cap": 1e4},
    "dppo_kl": {**_GRPO_DIFF, "policy_loss": "dppo_kl", "clip_low": 0.05, "clip_high": 0.05, "is_cap": 1e4},
    "m2po": {**_GRPO_DIFF, "policy_loss": "m2po"},
    "dr_grpo": {**_GRPO_DIFF, "loss_agg": "seq-mean-token-sum-norm", "grpo_std_normalize": False},
    "dapo": {**_GRPO_DIFF, "clip_high": 0.28, "dynamic_sampling": True},
}


def test_algorithm_config_defaults():
    assert dataclasses.asdict(AlgorithmConfig()) == DEFAULTS


def test_every_preset_differs_from_the_defaults_exactly_as_the_table_says():
    assert list(ALGORITHMS) == list(PRESETS)
    for name, diff in PRESETS.items():
        fields = dataclasses.asdict(ALGORITHMS[name])
        assert fields["name"] == name
        assert {k: v for k, v in fields.items() if k != "name" and v != DEFAULTS[k]} == diff, name


@pytest.mark.parametrize("field, bad, message", [
    ("ratio_level", "word", "^ratio_level must be one of token, turn, sequence; got 'word'$"),
    ("loss_agg", "sum", "^loss_agg must be one of token-mean, seq-mean-token-mean, seq-mean-token-sum-norm; "
                        "got 'sum'$"),
    ("kl_estimator", "k4", "^kl_estimator must be one of k1, k2, k3, low_var_kl; got 'k4'$"),
    ("rollout_correction", "is", "^rollout_correction must be one of auto, none, tis, mis; got 'is'$"),
    ("rollout_correction_level", "row", "^rollout_correction_level must be one of auto, token, turn, sequence; "
                                        "got 'row'$"),
    ("rollout_correction_cap", 0.99, "^rollout_correction_cap must be >= 1, got 0.99$"),
    ("clip_low", 1.01, r"^need 0 <= clip_low <= 1 and clip_high >= 0, got 1.01, 0.2$"),
    ("clip_low", -0.01, "clip_low"),
    ("clip_high", -0.01, r"^need 0 <= clip_low <= 1 and clip_high >= 0, got 0.2, -0.01$"),
    ("loss_scale_factor", 0.0, "^loss_scale_factor must be > 0, got 0.0$"),
    ("tau_pos", 0.0, "^tau_pos must be > 0, got 0.0$"),
    ("tau_neg", -1.0, "^tau_neg must be > 0, got -1.0$"),
    ("is_cap", 0.0, "^is_cap must be > 0, got 0.0$"),
    ("m2_threshold", 0.0, "^m2_threshold must be > 0, got 0.0$"),
    ("max_resample_rounds", -1, "^max_resample_rounds must be >= 0, got -1$"),
    ("clip_bias_kappa", 0.0, "^clip_bias_kappa must be > 0, got 0.0$"),
    ("gamma", 1.01, r"^gamma and lam must be in \[0, 1\], got 1.01, 1.0$"),
    ("gamma", -0.1, "gamma and lam"),
    ("lam", 1.5, r"^gamma and lam must be in \[0, 1\], got 1.0, 1.5$"),
    ("lam", -0.5, "gamma and lam"),
])
def test_algorithm_config_refuses_bad_values(field, bad, message):
    with pytest.raises(ValueError, match=message):
        AlgorithmConfig(**{field: bad})


def test_algorithm_config_accepts_the_boundaries():
    config = AlgorithmConfig(clip_low=0.0, clip_high=0.0, rollout_correction_cap=1.0, max_resample_rounds=0,
                             gamma=0.0, lam=0.0, clip_bias_kappa=1e-9, loss_scale_factor=1e-9, tau_pos=1e-9,
                             tau_neg=1e-9, is_cap=1e-9, m2_threshold=1e-9)
    assert config.clip_low == 0.0 and config.max_resample_rounds == 0
    assert AlgorithmConfig(clip_low=0.999, gamma=1.0, lam=1.0).clip_low == 0.999
    for level in ("token", "turn", "sequence"):
        assert AlgorithmConfig(ratio_level=level, rollout_correction_level=level).ratio_level == level
    for correction in ("auto", "none", "tis", "mis"):
        assert AlgorithmConfig(rollout_correction=correction).rollout_correction == correction
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert AlgorithmConfig(loss_agg=agg).loss_agg == agg
    for estimator in ("k1", "k2", "k3", "low_var_kl"):
        assert AlgorithmConfig(kl_estimator=estimator).kl_estimator == estimator


def test_register_algorithm_adds_a_preset_under_its_name():
    mine = AlgorithmConfig(name="pin_algo", clip_high=0.3)
    try:
        assert register_algorithm(mine) is mine and ALGORITHMS["pin_algo"] is mine
        with pytest.raises(ValueError, match="^algorithm 'pin_algo' is already registered"):
            register_algorithm(mine)
    finally:
        ALGORITHMS._items.pop("pin_algo", None)
