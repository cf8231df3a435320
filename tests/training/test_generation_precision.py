"""generation_autocast_dtype (the stress benchmark's precision stressor): the sampler computes in bfloat16 while the
learner stays float32, the gap a bfloat16 inference engine opens; it is logged, corrected by TIS under `auto`,
recorded, replayed exactly, and refused where there is no float32 learner to differ from."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import merged
from stppo_agent.training.replay import replay
from stppo_agent.training.trainer import Trainer
from tests.support.runs import TIMING, toy_config


def config(model: Path, out: Path, algo: str = "ppo", **overrides):
    values = dict(iterations=1, rollout=dict(prompts_per_iteration=4, samples_per_prompt=4, temperature=1.0),
                  optimizer=dict(epochs=1, mini_batch_size=16, micro_batch_size=8))
    values = merged(values, overrides)
    return toy_config(model, out, algo, **values)


def test_a_bfloat16_sampler_opens_a_logged_gap_that_auto_corrects(tiny_model, tmp_path):
    Trainer(config(tiny_model, tmp_path / "same"), report=lambda _: None).train()
    Trainer(config(tiny_model, tmp_path / "gap", precision=dict(generation_autocast_dtype="bfloat16")),
            report=lambda _: None).train()
    same, gap = read_metrics(tmp_path / "same")[-1], read_metrics(tmp_path / "gap")[-1]
    # a float32 sampler scores what the float32 learner does (to rounding); a bfloat16 one does not
    assert same["rollout_logprob_diff"] < 1e-5 and "rollout_correction/truncated_frac" not in same
    assert gap["rollout_logprob_diff"] > 1e-4
    assert "rollout_correction/truncated_frac" in gap  # auto: TIS, as for vLLM
    recorded = yaml.safe_load((tmp_path / "gap" / "config.yaml").read_text())
    assert recorded["precision"]["generation_autocast_dtype"] == "bfloat16"


def test_auto_correction_follows_the_sampler_and_an_explicit_choice_wins(tiny_model, tmp_path):
    assert config(tiny_model, tmp_path).algorithm_config().rollout_correction == "none"
    bf16 = config(tiny_model, tmp_path, precision=dict(generation_autocast_dtype="bfloat16"))
    assert (bf16.algorithm_config().rollout_correction, bf16.algorithm_config().rollout_correction_level) == \
        ("tis", "token")
    turn = config(tiny_model, tmp_path, algo="st_ppo", precision=dict(generation_autocast_dtype="bfloat16"))
    assert turn.algorithm_config().rollout_correction_level == "turn"
    uncorrected = config(tiny_model, tmp_path, algorithm={"rollout_correction": "none"},
                         precision=dict(generation_autocast_dtype="bfloat16"))
    assert uncorrected.algorithm_config().rollout_correction == "none"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"precision": {"generation_autocast_dtype": "float16"}}, "generation_autocast_dtype must be bfloat16"),
    ({"precision": {"generation_autocast_dtype": "bfloat16", "autocast_dtype": "bfloat16"}},
     "neither precision.autocast_dtype"),
    ({"precision": {"generation_autocast_dtype": "bfloat16", "autocast_dtype": "auto"}},
     "neither precision.autocast_dtype"),
    ({"precision": {"generation_autocast_dtype": "bfloat16", "dtype": "bfloat16"}}, "needs precision.dtype=float32"),
    ({"precision": {"generation_autocast_dtype": "bfloat16"}, "rollout": {"backend": "vllm"}},
     "for rollout.backend=hf"),
])
def test_settings_without_a_float32_learner_are_refused(tiny_model, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(tiny_model, tmp_path, **overrides).validate()


def test_a_run_with_a_bfloat16_sampler_replays_exactly(tiny_model, tmp_path):
    run = tmp_path / "run"
    Trainer(config(tiny_model, run, iterations=2, logging=dict(save_rollouts=True),
                   precision=dict(generation_autocast_dtype="bfloat16")),
            report=lambda _: None).train()
    replay(run, None, str(tmp_path / "again"), report=lambda _: None)
    original, again = read_metrics(run), read_metrics(tmp_path / "again")
    assert len(original) == len(again) == 2 and original[-1]["rollout_logprob_diff"] > 1e-4
    for a, b in zip(original, again):
        for key in sorted(set(a) - TIMING):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
