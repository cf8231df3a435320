"""``stppo_agent.algorithms.rollout_correction``: TIS / MIS at token,
turn and sequence level against plain loops and by hand -- the cap, the clamp of the log-weight, ``auto`` per
backend and level, and its metrics."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from stppo_agent.algorithms import (
    ALGORITHMS,
    AlgorithmConfig,
    aggregate,
    get_policy_loss,
    resolve_rollout_correction,
    rollout_correction_weights,
)
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.trainer import Trainer
from tests.support import algorithm_reference as ref
from tests.support.runs import toy_config

LEVELS = ("token", "turn", "sequence")


def mismatched_batch(seed: int, batch: int = 5, length: int = 24):
    rng = random.Random(seed)
    mask, turns = ref.random_layout(rng, batch, length)
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=generator, dtype=torch.float64) * 3
    sample = old + torch.randn(batch, length, generator=generator, dtype=torch.float64) * 0.6
    return old, sample, mask, turns


def ref_weights(old, sample, mask, turns, level, mode, cap):
    """w' per token by a plain loop: the mean of (old - sample) over the token's turn / row, exp, then the cap."""
    log_w = ref.ref_log_ratio(old, sample, mask, turns, level)
    out = torch.zeros_like(old)
    for b, t in zip(*torch.nonzero(mask, as_tuple=True)):
        w = math.exp(float(log_w[b, t]))
        out[b, t] = min(w, cap) if mode == "tis" else (w if w <= cap else 0.0)
    return out


@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_match_a_plain_loop(seed, level, mode):
    old, sample, mask, turns = mismatched_batch(seed)
    config = AlgorithmConfig(rollout_correction=mode, rollout_correction_level=level, rollout_correction_cap=1.5)
    weights, metrics = rollout_correction_weights(old, sample, mask, turns, config)
    expected = ref_weights(old, sample, mask, turns, level, mode, 1.5)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=1e-6)
    raw = ref_weights(old, sample, mask, turns, level, "tis", float("inf"))[mask]
    share = float((raw > 1.5).double().mean())
    key = "truncated_frac" if mode == "tis" else "masked_frac"
    assert metrics[f"rollout_correction/{key}"] == pytest.approx(share)
    assert metrics["rollout_correction/weight_max"] == pytest.approx(float(raw.max()), rel=1e-5)
    assert metrics["rollout_correction/weight_mean"] == pytest.approx(float(raw.mean()), rel=1e-5)
    token_l = (old - sample)[mask]
    assert metrics["rollout_correction/kl"] == pytest.approx(float((token_l.exp() - 1 - token_l).mean()), rel=1e-5)
    assert metrics["rollout_logprob_diff"] == pytest.approx(float(token_l.abs().mean()), rel=1e-5)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("level", LEVELS)
def test_weighted_advantages_equal_a_weighted_clipped_surrogate(level, agg):
    old, sample, mask, turns = mismatched_batch(3)
    generator = torch.Generator().manual_seed(7)
    logprobs = (old + torch.randn(old.shape, generator=generator, dtype=torch.float64) * 0.3).requires_grad_()
    advantages = torch.randn(old.shape, generator=generator, dtype=torch.float64)
    config = AlgorithmConfig(ratio_level="turn", loss_agg=agg, rollout_correction="tis",
                             rollout_correction_level=level, rollout_correction_cap=1.5)
    weights, _ = rollout_correction_weights(old, sample, mask, turns, config)
    loss, bias, _ = get_policy_loss("ppo_clip")(logprobs=logprobs, old_logprobs=old, advantages=advantages * weights,
                                                loss_mask=mask, turn_ids=turns, config=config)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # the reference: each token's unweighted clipped loss (plain loop) times its weight, aggregated
    rho = torch.exp(ref.ref_log_ratio(logprobs.detach(), old, mask, turns, "turn"))
    per_token = {}
    for b, t in zip(*torch.nonzero(mask, as_tuple=True)):
        b, t = int(b), int(t)
        r, a = float(rho[b, t]), float(advantages[b, t])
        per_token[b, t] = float(weights[b, t]) * -min(r * a, min(max(r, 0.8), 1.2) * a)
    assert float(loss.detach()) == pytest.approx(ref.ref_aggregate(per_token, mask, agg), rel=1e-9, abs=1e-12)
    # and the gradient is the weighted sum of the per-token gradients, computed with torch directly
    x = logprobs.detach().clone().requires_grad_()
    from stppo_agent.algorithms import log_ratio_at_level

    ratio = torch.exp(log_ratio_at_level(x, old, mask, turns, "turn"))
    unweighted = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    (expected_grad,) = torch.autograd.grad(aggregate(unweighted * weights, mask, agg), x)
    torch.testing.assert_close(grad, expected_grad)


def test_correction_off_measures_the_mismatch_and_changes_nothing():
    old, sample, mask, turns = mismatched_batch(4)
    weights, metrics = rollout_correction_weights(old, sample, mask, turns, AlgorithmConfig(
        rollout_correction="none", rollout_correction_level="token"))
    assert weights is None and metrics["rollout_correction/kl"] > 0
    assert "rollout_correction/truncated_frac" not in metrics
    with pytest.raises(ValueError, match="resolve it"):
        rollout_correction_weights(old, sample, mask, turns, AlgorithmConfig())


def test_auto_is_on_for_vllm_at_the_algorithms_level_and_off_for_transformers():
    st = resolve_rollout_correction(ALGORITHMS["st_ppo"], "vllm")
    assert (st.rollout_correction, st.rollout_correction_level, st.rollout_correction_cap) == ("tis", "turn", 2.0)
    ppo = resolve_rollout_correction(ALGORITHMS["ppo"], "vllm")
    assert (ppo.rollout_correction, ppo.rollout_correction_level) == ("tis", "token")
    assert resolve_rollout_correction(ALGORITHMS["st_ppo"], "hf").rollout_correction == "none"
    chosen = TrainConfig(model="m", algo="grpo", algorithm={"rollout_correction": "mis",
                                                            "rollout_correction_level": "sequence",
                                                            "rollout_correction_cap": 3}).algorithm_config()
    assert (chosen.rollout_correction, chosen.rollout_correction_level, chosen.rollout_correction_cap) == \
        ("mis", "sequence", 3.0)
    with pytest.raises(ValueError, match="rollout_correction must be one of"):
        TrainConfig(model="m", algorithm={"rollout_correction": "is"}).algorithm_config()


def test_trainer_applies_the_weights_mis_above_the_cap_silences_the_policy_gradient(tiny_model, tmp_path):
    def sampler_far_from_trainer(batch):  # the sampler gave every token -30: w = pi_old / pi_s >> cap
        batch.sample_logprobs = torch.where(batch.loss_mask, torch.full_like(batch.sample_logprobs, -30.0), 0.0)

    config = toy_config(tiny_model, tmp_path / "mis", "grpo", iterations=2,
                        algorithm={"kl_in_reward": 0.0, "kl_loss_coef": 0.0, "rollout_correction": "mis"},
                        monitor=dict(on_collapse="none"))
    Trainer(config, batch_hook=sampler_far_from_trainer).train()
    records = read_metrics(tmp_path / "mis")
    assert all(r["rollout_correction/masked_frac"] == 1.0 for r in records)
    assert all(r["grad_norm"] == 0.0 for r in records)  # every token dropped: no policy gradient at all
    config = toy_config(tiny_model, tmp_path / "tis", "grpo", iterations=2,
                        algorithm={"kl_in_reward": 0.0, "kl_loss_coef": 0.0, "rollout_correction": "tis"},
                        monitor=dict(on_collapse="none"))
    Trainer(config, batch_hook=sampler_far_from_trainer).train()
    records = read_metrics(tmp_path / "tis")
    assert all(r["rollout_correction/truncated_frac"] == 1.0 and r["grad_norm"] > 0 for r in records)


def test_a_share_without_policy_tokens_still_carries_weights_when_the_correction_is_on():
    """Ranks merge their scored shares; one share without weights beside others with them would not merge."""
    old, sample, mask, turns = mismatched_batch(5)
    empty = torch.zeros_like(mask)
    on = AlgorithmConfig(rollout_correction="mis", rollout_correction_level="token")
    weights, metrics = rollout_correction_weights(old, sample, empty, turns, on)
    assert weights is not None and weights.shape == old.shape and not weights.any() and metrics == {}
    off = dataclasses.replace(on, rollout_correction="none")
    assert rollout_correction_weights(old, sample, empty, turns, off)[0] is None


def test_resolve_rollout_correction_auto_per_backend_and_level():
    turn = AlgorithmConfig(ratio_level="turn")
    resolved = resolve_rollout_correction(turn, "vllm")
    assert (resolved.rollout_correction, resolved.rollout_correction_level) == ("tis", "turn")
    resolved = resolve_rollout_correction(AlgorithmConfig(ratio_level="sequence"), "transformers")
    assert (resolved.rollout_correction, resolved.rollout_correction_level) == ("none", "token")
    explicit = AlgorithmConfig(rollout_correction="mis", rollout_correction_level="sequence")
    resolved = resolve_rollout_correction(explicit, "vllm")
    assert (resolved.rollout_correction, resolved.rollout_correction_level) == ("mis", "sequence")
    assert resolve_rollout_correction(turn, "transformers").ratio_level == "turn"


def _correction(correction, level="token", cap=2.0):
    mask = torch.tensor([[True, True, False, True], [True, False, False, False]])
    turns = torch.tensor([[0, 0, -1, 1], [0, -1, -1, -1]])
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-2.0, 0.0, 0.0, 0.0]])
    # token weights exp(old - sample): 3, 0.5, (masked: e^30), 2 (at the cap), 1
    sample = old - torch.tensor([[math.log(3.0), math.log(0.5), 30.0, math.log(2.0)], [0.0, 5.0, 5.0, 5.0]])
    config = AlgorithmConfig(rollout_correction=correction, rollout_correction_level=level,
                             rollout_correction_cap=cap)
    return rollout_correction_weights(old, sample, mask, turns, config), mask


def test_rollout_correction_metrics_and_the_tis_cap():
    (weights, metrics), _ = _correction("tis")
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]]))
    logs = [math.log(3.0), math.log(0.5), math.log(2.0), 0.0]
    assert metrics["rollout_logprob_diff"] == pytest.approx(sum(abs(x) for x in logs) / 4, rel=1e-5)
    assert metrics["rollout_correction/kl"] == pytest.approx(sum(math.expm1(x) - x for x in logs) / 4, rel=1e-5)
    assert metrics["rollout_correction/weight_mean"] == pytest.approx(6.5 / 4, rel=1e-5)
    assert metrics["rollout_correction/weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert metrics["rollout_correction/weight_p99"] == pytest.approx(2.0 + 0.97 * 1.0, rel=1e-4)
    assert metrics["rollout_correction/truncated_frac"] == pytest.approx(0.25)  # 2 at the cap is not above it
    assert "rollout_correction/masked_frac" not in metrics


def test_rollout_correction_mis_masks_above_the_cap_and_none_only_measures():
    (weights, metrics), _ = _correction("mis")
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.5, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]]))
    assert metrics["rollout_correction/masked_frac"] == pytest.approx(0.25)
    assert "rollout_correction/truncated_frac" not in metrics
    (weights, metrics), _ = _correction("none")
    assert weights is None and metrics["rollout_correction/weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert not any(key.endswith("_frac") for key in metrics)
    (weights, metrics), _ = _correction("tis", cap=4.0)
    torch.testing.assert_close(weights, torch.tensor([[3.0, 0.5, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]]))
    assert metrics["rollout_correction/truncated_frac"] == 0.0


def test_rollout_correction_at_turn_and_sequence_level_uses_geometric_means():
    (weights, metrics), _ = _correction("tis", level="turn", cap=10.0)
    g = math.sqrt(1.5)  # turn 0 of row 0: sqrt(3 * 0.5)
    torch.testing.assert_close(weights, torch.tensor([[g, g, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]]))
    assert metrics["rollout_correction/weight_max"] == pytest.approx(2.0, rel=1e-5)
    # the token-level mismatch metrics do not depend on the level
    assert metrics["rollout_correction/kl"] == pytest.approx(
        sum(math.expm1(x) - x for x in [math.log(3.0), math.log(0.5), math.log(2.0), 0.0]) / 4, rel=1e-5)
    (weights, _), _ = _correction("mis", level="sequence", cap=1.5)
    row0 = 3.0 ** (1 / 3)  # (3 * 0.5 * 2) ** (1 / 3) = 1.44 <= 1.5
    torch.testing.assert_close(weights, torch.tensor([[row0, row0, 0.0, row0], [1.0, 0.0, 0.0, 0.0]]))


def test_rollout_correction_refuses_auto_and_weighs_a_batch_without_policy_tokens_zero():
    with pytest.raises(ValueError, match="^rollout_correction is 'auto': resolve it for the generation backend "
                                         r"first \(resolve_rollout_correction\)$"):
        rollout_correction_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                                   torch.zeros(1, 2, dtype=torch.long),
                                   AlgorithmConfig(rollout_correction_level="token"))
    with pytest.raises(ValueError, match="auto"):
        rollout_correction_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                                   torch.zeros(1, 2, dtype=torch.long), AlgorithmConfig(rollout_correction="tis"))
    config = AlgorithmConfig(rollout_correction="tis", rollout_correction_level="token")
    weights, metrics = rollout_correction_weights(torch.zeros(1, 2), torch.ones(1, 2),
                                                  torch.zeros(1, 2, dtype=torch.bool),
                                                  torch.zeros(1, 2, dtype=torch.long), config)
    assert torch.equal(weights, torch.zeros(1, 2)) and metrics == {}  # zero weights, so that shares merge


def test_rollout_correction_clamps_the_log_weight_at_20():
    config = AlgorithmConfig(rollout_correction="none", rollout_correction_level="token")
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, metrics = rollout_correction_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[-30.0, 0.0]]), mask,
                                            torch.zeros(1, 2, dtype=torch.long), config)
    assert metrics["rollout_correction/weight_max"] == pytest.approx(math.exp(20.0), rel=1e-5)
    assert metrics["rollout_correction/kl"] == pytest.approx((math.expm1(20.0) - 20.0) / 2, rel=1e-5)
    assert metrics["rollout_logprob_diff"] == pytest.approx(15.0)  # the raw difference, not clamped
