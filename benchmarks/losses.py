"""Forward+backward time of each preset's policy loss, as a ratio to token-level PPO in the same run.

    python benchmarks/losses.py [--batch 64] [--length 4096] [--repeats 20] [--turn-drift 0.2] [--token-noise 0.3]

Targets: turn-level <= 1.3x token-level; the clip-bias correction's extra cost is reported as a
ratio (it is one extra backward of the loss graph; with a real model it is one extra backward of the model
on the micro-batch, which the trainer benchmark measures).

The batch is off-policy the way a later mini-batch is: each turn's log-probs moved by a shared drift
(N(0, turn_drift) per turn) plus per-token noise (N(0, token_noise)), so that turn-level ratios leave the clip
range too (per-token noise alone averages out over a turn's hundreds of tokens and a turn-level loss then clips
nothing, which would time a skipped no-op). The share of clipped tokens and of clipped turns is printed for every
preset; a correction is timed only where something is clipped.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import _common  # noqa: F401  (puts the repository on sys.path)
import torch

from stppo_agent.algorithms import ALGORITHMS, ClipBiasCorrector, get_advantage_estimator, get_policy_loss


def make_batch(batch: int, length: int, seed: int = 0, turn_drift: float = 0.2, token_noise: float = 0.3):
    """A Search-R1-like layout: 2-5 turns of 50-400 policy tokens with 100-600-token observations between."""
    rng = random.Random(seed)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    turns = torch.full((batch, length), -1, dtype=torch.long)
    for b in range(batch):
        position = 0
        for k in range(rng.randint(2, 5)):
            size = rng.randint(50, 400)
            end = min(length, position + size)
            mask[b, position:end], turns[b, position:end] = True, k
            position = end + rng.randint(100, 600)
            if position >= length:
                break
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen) * 3
    drift = turn_drift * torch.randn(batch, int(turns.max()) + 2, generator=gen)
    per_token_drift = torch.where(mask, drift.gather(1, turns.clamp(min=0)), torch.zeros(()))
    logprobs = old + per_token_drift + token_noise * torch.randn(batch, length, generator=gen)
    values = torch.randn(batch, length, generator=gen)
    rewards = torch.randint(0, 2, (batch,), generator=gen).float()
    groups = torch.arange(batch) // 8
    return mask, turns, logprobs, old, values, rewards, groups


def prepare(name: str, data):
    mask, turns, logprobs, old, values, rewards, groups = data
    preset = ALGORITHMS[name]
    advantages, _ = get_advantage_estimator(preset.advantage)(
        rewards=rewards, values=values, loss_mask=mask, group_ids=groups, config=preset)
    return preset, advantages


def clipped_shares(preset, advantages, data) -> tuple[float, float]:
    """(share of policy tokens in the clipped branch at the preset's ratio level, share of turns clipped)."""
    mask, turns, logprobs, old, *_ = data
    _, _, metrics = get_policy_loss(preset.policy_loss)(
        logprobs=logprobs, old_logprobs=old, advantages=advantages, loss_mask=mask, turn_ids=turns, config=preset)
    return float(metrics["clip_frac"]), float(metrics["turn_clip_frac"])


def time_once(preset, advantages, data) -> tuple[float, float]:
    """Seconds of (loss forward + backward) and of the clip-bias correction's extra backward, one step."""
    mask, turns, logprobs, old, *_ = data
    theta = torch.nn.Parameter(logprobs.clone())
    corrector = ClipBiasCorrector([theta], preset.clip_bias_kappa)
    start = time.perf_counter()
    loss, bias, _ = get_policy_loss(preset.policy_loss)(
        logprobs=theta, old_logprobs=old, advantages=advantages, loss_mask=mask, turn_ids=turns, config=preset)
    middle = time.perf_counter()
    if preset.clip_bias_correction:
        corrector.accumulate(bias)
    after_correction = time.perf_counter()
    loss.backward()
    if preset.clip_bias_correction:
        corrector.apply()
    end = time.perf_counter()
    return (middle - start) + (end - after_correction), after_correction - middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--turn-drift", type=float, default=0.2, help="std of each turn's shared log-prob shift")
    parser.add_argument("--token-noise", type=float, default=0.3, help="std of per-token log-prob noise")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = make_batch(args.batch, args.length, turn_drift=args.turn_drift, token_noise=args.token_noise)
    print(f"B={args.batch} T={args.length} policy tokens={int(data[0].sum())} threads={torch.get_num_threads()}")
    prepared = {name: prepare(name, data) for name in ALGORITHMS}
    samples = {name: [] for name in prepared}
    for repeat in range(args.repeats + 3):  # round-robin, so machine noise hits every preset alike
        for name, (preset, advantages) in prepared.items():
            if repeat >= 3:  # the first rounds are warm-up
                samples[name].append(time_once(preset, advantages, data))
    # ratios per round (the presets of a round ran back to back), then their median and range over the rounds
    print(f"{args.repeats} rounds; ratios as median (min-max) over the rounds")
    print(f"{'preset':10s} {'ms':>8s} {'vs ppo':>18s} {'clipped tok':>12s} {'clipped turns':>14s} "
          f"{'correction ms':>14s} {'correction / step':>18s}")
    for name, (preset, advantages) in prepared.items():
        step = statistics.median(s for s, _ in samples[name])
        correction = statistics.median(c for _, c in samples[name])
        tokens, turns = clipped_shares(preset, advantages, data)
        versus = spread([s / base for (s, _), (base, _) in zip(samples[name], samples["ppo"])])
        extra = f"{correction * 1e3:14.1f} {spread([c / s for s, c in samples[name]]):>18s}" \
            if preset.clip_bias_correction else ""
        print(f"{name:10s} {step * 1e3:8.1f} {versus:>18s} {tokens:12.3f} {turns:14.3f} {extra}")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


if __name__ == "__main__":
    main()
