"""The off-policy stress options in a whole run: recorded in config.yaml, and a run stopped and resumed, or replayed
from its recorded rollouts, logs what the uninterrupted run logged -- old_logprobs=sampler (with a bfloat16 sampler,
with staleness), algorithm.clip_ratio_c with clip_bias_order=after_grad_clip, and the metrics they add."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import merged
from stppo_agent.training.replay import replay
from stppo_agent.training.trainer import Trainer
from tests.support.runs import TIMING, toy_config

NO_KL = {"kl_in_reward": 0.0, "kl_loss_coef": 0.0}
OPTIONS = {
    "sampler_bf16": ("ppo", {"rollout": {"old_logprobs": "sampler"},
                             "precision": {"generation_autocast_dtype": "bfloat16"}}),
    "sampler_stale": ("ppo", {"rollout": {"old_logprobs": "sampler", "staleness": 1}}),
    "dual_clip_after": ("st_ppo", {"algorithm": {**NO_KL, "clip_ratio_c": 1.2, "clip_bias_order": "after_grad_clip",
                                                 "clip_bias_kappa": 0.05}}),
}


def run_config(model: Path, out: Path, name: str, **overrides):
    algo, options = OPTIONS[name]
    values = dict(iterations=3, rollout=dict(prompts_per_iteration=4, samples_per_prompt=4),
                  optimizer=dict(epochs=2, mini_batch_size=8, micro_batch_size=4, actor_lr=5e-2, critic_lr=1e-2),
                  logging=dict(step_diagnostics=True), monitor=dict(on_collapse="none"))
    values = merged(values, options, overrides)
    return toy_config(model, out, algo, **values)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_an_option_is_recorded_resumed_and_replayed_exactly(tiny_model, tmp_path, name):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    Trainer(run_config(tiny_model, straight, name, logging=dict(save_rollouts=True)), report=lambda _: None).train()
    Trainer(run_config(tiny_model, stopped, name, iterations=2, checkpoint=dict(every=1)),
            report=lambda _: None).train()
    Trainer(run_config(tiny_model, stopped, name), resume=True, report=lambda _: None).train()
    replay(straight, None, str(tmp_path / "replayed"), report=lambda _: None)
    recorded = yaml.safe_load((straight / "config.yaml").read_text())
    for key, value in OPTIONS[name][1].items():
        if isinstance(value, dict):  # the algorithm's fields or a config section: the fields the option set
            assert {field: recorded[key][field] for field in value} == value, key
        else:
            assert recorded[key] == value, key
    a, b, c = read_metrics(straight), read_metrics(stopped), read_metrics(tmp_path / "replayed")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [r["step"] for r in c] == [1, 2, 3]
    for x, y, z in zip(a, b, c):
        for key in sorted(set(x) - TIMING):
            assert x[key] == y[key], ("resume", x["step"], key, x[key], y[key])
            assert x[key] == z[key], ("replay", x["step"], key, x[key], z[key])
    assert all("ratio/ess" in r for r in a)
    if name == "dual_clip_after":
        assert max(r["dual_clip_frac"] for r in a) > 0
        steps = [json.loads(line) for line in (straight / "steps.jsonl").read_text().splitlines()]
        # after gradient clipping every scale above 1 changes the applied gradient
        assert all(s["clip_bias_changed"] == float(s["clip_bias_scale"] > 1) for s in steps)
        assert any(s["clip_bias_changed"] == 1.0 for s in steps)
