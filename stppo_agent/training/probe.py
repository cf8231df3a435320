"""The learner probe (``monitor.probe_every: N``, ``monitor.probe_prompts: M``): every N iterations, after the update,
the *current* actor plays M fixed prompts, and ``probe/reward``, ``probe/invalid_action_rate``, ``probe/entropy`` (minus
the mean log-probability of the tokens it sampled: an estimate of the learner's entropy per token) and
``probe/policy_version`` (the actor's optimizer steps so far) go into that iteration's metrics.

Why: under ``rollout.staleness`` K a batch shows the generating weights, K updates old, so a read-out of rollout
rewards dates a collapse K iterations late and never sees the learner's last K updates. The probe plays the
learner itself, on the same prompts every time, so its series is a curve of the policy being trained.

A run with probes trains exactly as one without (tests/training/test_probe.py holds it to that):

- the probe has envs of its own (an env's episode counter is state: the toy env's ``reward_flip_episodes``
  counts episodes) and a generation backend of its own over the actor (no key/value caches shared with the
  rollouts);
- it samples at the run's temperature / top-k / top-p from torch's generators forked for the call and seeded from
  the run's seed and the iteration (:func:`probe_seed`), so the training streams continue as if it had not run,
  and a resumed run probes exactly as an uninterrupted one;
- its envs are reset with fixed seeds, never from the global numpy or Python streams.

The prompts are the first M of a permutation of the envs' prompts (examples, or a synthetic env's indexed prompts:
``stppo_agent.rollouts.envs.prompt_count``) seeded apart from the training sampler's. The actor samples at
the learner's precision (``precision.generation_autocast_dtype`` is the sampler's, not the learner's). With several
processes every rank plays the same probe (an FSDP2 actor is gathered for it, a collective); rank 0 logs it.
"""

from __future__ import annotations

import time

import torch

from stppo_agent.distributed import process_group
from stppo_agent.rollouts.envs import make_env, prompt_count
from stppo_agent.rollouts.hf_generation import HFGenerationBackend
from stppo_agent.rollouts.turn_loop import collect_rollouts

PROBE_SEED = 982_451_653  # apart from the training sampler's seeds (seed, seed + 1, ...) and episode seeds
KEYS = ("probe/reward", "probe/invalid_action_rate", "probe/entropy", "probe/policy_version")


def probe_seed(seed: int, iteration: int) -> int:
    """The torch seed of the probe after ``iteration`` updates of a run with ``seed``."""
    return (seed * 1_000_003 + iteration + PROBE_SEED) % 2**63


class LearnerProbe:
    """M fixed prompts played by a model at the run's sampling settings (see the module docstring)."""

    def __init__(self, config, tokenizer, env_kwargs: list[dict] | None = None):
        from stppo_agent.training.live_rollouts import PromptSampler

        self.config, self.tokenizer = config, tokenizer
        env_ids = [e.strip() for e in config.env.split(",") if e.strip()]
        kwargs = env_kwargs or [dict(config.env_kwargs) for _ in env_ids]
        sizes = [prompt_count(make_env(env_id, kw)) for env_id, kw in zip(env_ids, kwargs)]
        pairs = PromptSampler(sizes, config.seed + PROBE_SEED).take(config.monitor.probe_prompts)
        self.envs = [make_env(env_ids[e], kwargs[e]) for e, _ in pairs]  # one per trajectory, as in a rollout
        self.options = [{"index": example} for _, example in pairs]
        self.seeds = [config.seed + PROBE_SEED + slot for slot in range(len(pairs))]
        self.backend = None

    @classmethod
    def for_run(cls, config, tokenizer, env_kwargs: list[dict] | None = None) -> "LearnerProbe | None":
        """The run's probe (None without ``monitor.probe_every``); ``env_kwargs``: the rollout source's, so the probe's
        envs share its retriever."""
        if not config.monitor.probe_every:
            return None
        return cls(config, tokenizer, env_kwargs)

    def due(self, iteration: int) -> bool:
        """After ``iteration`` iterations (1-based count of updates done): every ``monitor.probe_every``-th."""
        return iteration % self.config.monitor.probe_every == 0

    def measure(self, model: torch.nn.Module, iteration: int, policy_version: int) -> dict[str, float]:
        """The probe's metrics for ``model`` as it is after ``iteration`` iterations and ``policy_version`` optimizer
        steps; the caller's random streams are as they were."""
        started = time.perf_counter()
        if self.backend is None or self.backend.model is not model:
            config = self.config
            self.backend = HFGenerationBackend(model, self.tokenizer, config.sampling(),
                                               batch_size=config.rollout.generation_batch_size,
                                               reuse_cache=config.rollout.reuse_kv_cache)
        device = next(model.parameters()).device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), process_group.gathered(model):
            torch.manual_seed(probe_seed(self.config.seed, iteration))
            batch = collect_rollouts(self.backend, self.tokenizer, self.envs, self.options,
                                     list(range(len(self.envs))), self.config.rollout_limits(), self.seeds)
        sampled = batch.sample_logprobs[batch.loss_mask]
        return {"probe/reward": float(batch.stats["reward"]),
                "probe/invalid_action_rate": float(batch.stats.get("invalid_action_rate", 0.0)),
                "probe/entropy": -float(sampled.mean()) if sampled.numel() else 0.0,
                "probe/policy_version": float(policy_version), "probe_seconds": time.perf_counter() - started}
