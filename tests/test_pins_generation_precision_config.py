"""Pins of stppo_agent/training/config.py's _check_generation_precision: each refusal word for word, and each of
the three learner settings that is not float32 refused on its own (dtype, autocast_dtype, fsdp_compute_dtype)."""

from __future__ import annotations

import re

import pytest

from stppo_agent.training.config import TrainConfig, from_dict, merged
from stppo_agent.training.config_sections import PrecisionConfig

NEEDS_FLOAT32 = ("precision.generation_autocast_dtype=bfloat16 samples in bfloat16 against a float32 learner: it "
                 "needs precision.dtype=float32 and neither precision.autocast_dtype nor precision.fsdp_compute_dtype")


def config(**values) -> TrainConfig:
    return from_dict(merged({"model": "m", "env": "stppo/Toy-v0",
                             "precision": {"generation_autocast_dtype": "bfloat16"}}, values))


def refused(message: str, **values) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        config(**values).validate()


def test_a_bfloat16_sampler_against_a_float32_ddp_or_fsdp2_learner_is_accepted():
    config().validate()
    config(distributed=dict(strategy="fsdp2")).validate()
    TrainConfig(model="m", env="stppo/Toy-v0",
                precision=PrecisionConfig(dtype="bfloat16")).validate()  # unset: no check of the learner


def test_the_sampler_dtype_and_backend_are_refused_word_for_word():
    refused("precision.generation_autocast_dtype must be bfloat16 (or unset), got 'float16'",
            precision=dict(generation_autocast_dtype="float16"))
    refused("precision.generation_autocast_dtype is for rollout.backend=hf (vLLM samples in its own dtype)",
            rollout=dict(backend="vllm"))


@pytest.mark.parametrize("learner", [
    {"precision": {"dtype": "bfloat16"}},
    {"precision": {"autocast_dtype": "bfloat16"}},
    {"distributed": {"strategy": "fsdp2"}, "precision": {"fsdp_compute_dtype": "bfloat16"}},
])
def test_each_learner_setting_that_is_not_float32_is_refused_alone(learner):
    refused(NEEDS_FLOAT32, **learner)
