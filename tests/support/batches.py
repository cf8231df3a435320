"""Random and hand-made batches of the algorithms' tests: random layouts with a seed and a
dtype, behaviour log-probs that are log-probabilities, and a policy gradient of a model whose parameters are the
log-probs themselves."""

from __future__ import annotations

import math
import random

import torch

from stppo_agent.algorithms import ClipBiasCorrector, get_policy_loss
from tests.support import algorithm_reference as ref

LEVELS = ("token", "turn", "sequence")


def tolerance(dtype):
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)


def random_batch(seed, dtype, spread=0.3):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch, length = rng.randint(1, 6), rng.randint(1, 40)
    mask, turns = ref.random_layout(rng, batch, length)
    logprobs = -torch.rand(batch, length, generator=gen, dtype=dtype) * 3
    old = logprobs + spread * torch.randn(batch, length, generator=gen, dtype=dtype)
    return dict(
        rng=rng, mask=mask, turns=turns, logprobs=logprobs, old=old,
        values=torch.randn(batch, length, generator=gen, dtype=dtype),
        rewards=torch.randint(0, 2, (batch,), generator=gen).to(dtype),
        advantages=torch.randn(batch, length, generator=gen, dtype=dtype),
        groups=torch.randint(0, 3, (batch,), generator=gen),
    )


def _policy_grads(config, data, micro_batches=None, with_correction=None):
    """Gradient of a tiny 'model' whose parameters are the logprobs themselves, with optional correction."""
    theta = torch.nn.Parameter(data["logprobs"].clone())
    correction = config.clip_bias_correction if with_correction is None else with_correction
    corrector = ClipBiasCorrector([theta], kappa=config.clip_bias_kappa)
    rows = micro_batches or [list(range(theta.shape[0]))]
    total_tokens = data["mask"].sum()
    total_seqs = data["mask"].any(1).sum()
    for index in rows:
        loss, bias, _ = get_policy_loss(config.policy_loss)(
            logprobs=theta[index], old_logprobs=data["old"][index], advantages=data["advantages"][index],
            loss_mask=data["mask"][index], turn_ids=data["turns"][index], config=config,
            global_num_tokens=total_tokens if micro_batches else None,
            global_num_seqs=total_seqs if micro_batches else None)
        if correction:
            corrector.accumulate(bias)
        loss.backward()
    metrics = corrector.apply() if correction else {}
    return theta.grad.clone(), metrics


# The 2025-26 stabilisers (CISPO, SAPO, GMPO, DPPO, M2PO, Dr. GRPO, DAPO) and per-turn GAE against plain loops, at
# token, turn and sequence level; M2PO's statistic over 2 gloo processes; DAPO's group filter; presets.


# Settings under which every rule's special branch is exercised on random_batch(spread=0.4): small DPPO thresholds
# and an is_cap inside the ratio range, an M2 threshold below the batch's second moment.
EXERCISE = dict(dppo_tv=dict(clip_low=0.05, clip_high=0.05, is_cap=1.5),
                dppo_kl=dict(clip_low=0.01, clip_high=0.01, is_cap=1.5), m2po=dict(m2_threshold=0.05))


def probability_batch(seed, dtype, spread=0.3):
    """test_algorithms' batches with behaviour log-probs that are log-probabilities (<= 0): DPPO reads the
    probabilities themselves."""
    data = random_batch(seed, dtype, spread)
    data["old"] = data["old"].clamp(max=-1e-3)
    return data


F64 = torch.float64


def t64(values):
    return torch.tensor(values, dtype=F64)


def _ratio_batch():
    """Two rows: (1.5, 0.8, 1.2) and (0.5, masked, 1.0) as ratios, turns (0, 0, 1) and (0, -, 1)."""
    mask = torch.tensor([[True, True, True], [True, False, True]])
    turns = torch.tensor([[0, 0, 1], [0, -1, 1]])
    old = t64([[-1.0, -2.0, -0.5], [-1.5, -3.0, -0.7]])
    log_ratio = t64([[math.log(1.5), math.log(0.8), math.log(1.2)], [math.log(0.5), 5.0, 0.0]])
    logprobs = (old + log_ratio).requires_grad_(True)
    advantages = t64([[1.0, -1.0, 2.0], [-2.0, 9.0, 0.0]])
    return logprobs, old, advantages, mask, turns
