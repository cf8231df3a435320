"""Which optimizer step counts as on-policy: an iteration's first step only when the ratio's denominator is the
actor's own weights as the learner computes them (ppo_update.starts_on_policy). Under rollout_staleness with the
coupled objective that step's ratio is pi / pi_{i-K}: it is off-policy, in the offpolicy/ means, and no gradient
cosine takes it as its on-policy reference."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.config_sections import PrecisionConfig, RolloutConfig
from stppo_agent.training.ppo_update import starts_on_policy
from stppo_agent.training.trainer import Trainer
from tests.support.runs import toy_config


def steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]


def stale_run(model: Path, out: Path, objective: str, mini_batch_size: int) -> None:
    config = toy_config(model, out, "ppo", iterations=3,
                        rollout=dict(prompts_per_iteration=4, samples_per_prompt=4, staleness=1,
                                     stale_objective=objective),
                        optimizer=dict(mini_batch_size=mini_batch_size, micro_batch_size=8, epochs=1, actor_lr=5e-2),
                        logging=dict(step_diagnostics=True), monitor=dict(on_collapse="none"))
    Trainer(config, report=lambda _: None).train()


def test_under_coupled_staleness_the_lagged_first_step_is_off_policy(tiny_model, tmp_path):
    stale_run(tiny_model, tmp_path, "coupled", mini_batch_size=16)  # one step per iteration
    records, metrics = steps(tmp_path), read_metrics(tmp_path)
    assert [r["on_policy"] for r in records] == [True, False, False]  # lag 0, then 1, 1
    # the lagged step's ratios are pi / pi_{i-1}, not 1: what the flag now says
    assert abs(records[1]["ratio_max"] - 1) > 1e-3 or abs(records[1]["ratio_min"] - 1) > 1e-3
    assert records[0]["grad_cos_to_first"] == 1.0
    assert "grad_cos_to_first" not in records[1] and "grad_cos_to_first" not in records[2]  # no reference
    assert "offpolicy/steps" not in metrics[0]
    for record in metrics[1:]:  # the one step of a stale iteration is in the off-policy means
        assert record["offpolicy/steps"] == 1.0
        assert record["offpolicy/tail/ratio_max"] == pytest.approx(record["tail/ratio_max"])
        assert "grad_cos_to_first" not in record and "offpolicy/grad_cos_to_first" not in record
    # the stability study reads such a run: off-policy steps without a cosine leave its cosine mean unset
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import stability

    summary = stability.summarize(tmp_path)
    assert summary["grad_cos_offpolicy_mean"] is None and summary["ratio_p99_offpolicy_mean"] > 1


def test_stale_iterations_take_no_step_as_the_cosine_reference(tiny_model, tmp_path):
    stale_run(tiny_model, tmp_path, "coupled", mini_batch_size=8)  # two steps per iteration
    records = steps(tmp_path)
    assert [(r["iteration"], r["on_policy"]) for r in records] == [(1, True), (1, False), (2, False), (2, False),
                                                                  (3, False), (3, False)]
    assert "grad_cos_to_first" in records[1]
    assert all("grad_cos_to_first" not in r for r in records[2:])
    assert read_metrics(tmp_path)[1]["offpolicy/steps"] == 2.0


def test_the_decoupled_objective_starts_every_iteration_on_policy(tiny_model, tmp_path):
    """Its ratio is against the current weights (the lag is the separate behaviour weight): 1 at the first step."""
    stale_run(tiny_model, tmp_path, "decoupled", mini_batch_size=16)
    records = steps(tmp_path)
    assert [r["on_policy"] for r in records] == [True, True, True]
    for record in records:
        assert record["ratio_max"] == pytest.approx(1.0, abs=1e-5)
        assert record["ratio_min"] == pytest.approx(1.0, abs=1e-5)


def _first_step(lag=0, old_logprobs="recompute", objective="coupled", backend="hf", autocast=None,
                sampled_by_actor=True) -> bool:
    config = TrainConfig(rollout=RolloutConfig(old_logprobs=old_logprobs, stale_objective=objective, backend=backend),
                         precision=PrecisionConfig(generation_autocast_dtype=autocast))
    return starts_on_policy(config, lag, sampled_by_actor)


@pytest.mark.parametrize(("settings", "on_policy"), [
    ({}, True),
    ({"lag": 2}, False),  # coupled: the lagged generator's log-probs
    ({"lag": 2, "objective": "decoupled"}, True),  # recomputed with the current weights
    ({"old_logprobs": "sampler"}, True),  # a sampler that computes as the learner: 1 up to rounding
    ({"old_logprobs": "sampler", "autocast": "bfloat16"}, False),  # the precision gap is in the ratio
    ({"old_logprobs": "sampler", "backend": "vllm"}, False),
    ({"old_logprobs": "sampler", "lag": 1}, False),
    ({"old_logprobs": "sampler", "sampled_by_actor": False}, False),  # a replay through another rule
    ({"old_logprobs": "sampler", "sampled_by_actor": True}, True),
    ({"autocast": "bfloat16", "backend": "vllm"}, True),  # recomputed: the sampler's precision does not matter
])
def test_which_first_steps_are_on_policy(settings, on_policy):
    assert _first_step(**settings) is on_policy
