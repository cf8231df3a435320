"""ratio/ess: the effective sample size (sum w)^2 / (n sum w^2) of the importance ratios at the level the algorithm
uses (one weight per policy token, turn or trajectory), per optimizer step: 1 on-policy, falling toward 1/n as
a few samples take the weight -- a collapse precursor beside the ratio tails."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from stppo_agent.algorithms import ALGORITHMS, AlgorithmConfig, get_policy_loss
from stppo_agent.algorithms.metrics import StepMetrics
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.trainer import Trainer
from tests.support import algorithm_reference as ref
from tests.support.batches import random_batch
from tests.support.runs import toy_config

LEVELS = ("token", "turn", "sequence")


def _metrics(config, data, rows=None):
    pick = (lambda x: x[rows]) if rows is not None else (lambda x: x)
    _, _, metrics = get_policy_loss(config.policy_loss)(
        logprobs=pick(data["logprobs"]), old_logprobs=pick(data["old"]), advantages=pick(data["advantages"]),
        loss_mask=pick(data["mask"]), turn_ids=pick(data["turns"]), config=config)
    return metrics


@pytest.mark.parametrize("rule", ["ppo_clip", "cispo", "m2po"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("seed", range(6))
def test_the_ess_is_that_of_one_weight_per_sample_at_the_ratio_level(seed, level, rule):
    data = random_batch(seed, torch.float64, spread=0.6)
    base = AlgorithmConfig() if rule == "ppo_clip" else ALGORITHMS[rule]
    config = dataclasses.replace(base, ratio_level=level)
    expected = ref.ref_effective_sample_size(data["logprobs"], data["old"], data["mask"], data["turns"], level)
    assert _metrics(config, data)["ratio/ess"].item() == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("level", LEVELS)
def test_the_ess_of_a_split_batch_is_the_whole_batchs(level):
    data = random_batch(3, torch.float64, spread=0.6)
    while data["mask"].shape[0] < 3 or data["mask"].sum() < 4:  # rows to split
        data = random_batch(int(data["mask"].shape[1]) + 11, torch.float64, spread=0.6)
    config = AlgorithmConfig(ratio_level=level)
    whole = _metrics(config, data)["ratio/ess"].item()
    combined = StepMetrics()
    half = data["mask"].shape[0] // 2
    for rows in (slice(0, half), slice(half, None)):
        part = _metrics(config, data, rows)
        combined.add(part, data["mask"][rows].sum())
    assert combined.reduce()["ratio/ess"] == pytest.approx(whole, rel=1e-9)
    assert whole < 1


def test_equal_weights_give_one_and_one_dominant_weight_gives_one_over_n():
    mask = torch.ones(1, 4, dtype=torch.bool)
    turns = torch.zeros(1, 4, dtype=torch.long)
    data = {"logprobs": torch.zeros(1, 4, dtype=torch.float64), "old": torch.zeros(1, 4, dtype=torch.float64),
            "advantages": torch.ones(1, 4, dtype=torch.float64), "mask": mask, "turns": turns}
    assert _metrics(AlgorithmConfig(), data)["ratio/ess"].item() == 1.0
    data["logprobs"] = torch.tensor([[15.0, 0.0, 0.0, 0.0]], dtype=torch.float64)  # one ratio e^15, three 1
    assert _metrics(AlgorithmConfig(), data)["ratio/ess"].item() == pytest.approx(0.25, rel=1e-5)
    # at turn level the four tokens are one turn, one sample: its ESS is 1 whatever its ratio
    assert _metrics(AlgorithmConfig(ratio_level="turn"), data)["ratio/ess"].item() == 1.0


def test_a_run_logs_it_per_step_one_on_policy_and_below_one_after(tmp_path):
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    config = toy_config(model, tmp_path / "run", "st_ppo", iterations=2,
                        rollout=dict(prompts_per_iteration=4, samples_per_prompt=4),
                        optimizer=dict(mini_batch_size=4, micro_batch_size=4, epochs=2, actor_lr=5e-2),
                        logging=dict(step_diagnostics=True))
    Trainer(config, report=lambda _: None).train()
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    first = [s["ratio/ess"] for s in steps if s["on_policy"]]
    later = [s["ratio/ess"] for s in steps if not s["on_policy"]]
    assert first and all(value == pytest.approx(1.0, abs=1e-9) for value in first)
    assert min(later) < 1 - 1e-4 and max(later) <= 1 + 1e-12
    for record in read_metrics(tmp_path / "run"):
        assert 0 < record["offpolicy/ratio/ess"] <= record["ratio/ess"] + 1e-12  # diluted by the on-policy step
