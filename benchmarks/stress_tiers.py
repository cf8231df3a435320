"""The stress grid's tiers: where it runs, each with the options of every run, its base learning rates, its read-out
count and whether its env counts invalid actions (benchmarks/stress.py describes them)."""

from __future__ import annotations

import dataclasses

import stability

SHARED = ["optimizer.warmup_steps=10"]  # every run's, the warm start's included: no level starts with a cold sign step


@dataclasses.dataclass(frozen=True)
class Tier:
    """Where the grid runs. ``iterations``: read-outs per run (policy versions 0..N-1); ``common``: options of every
    run; ``counts_invalid``: the env counts invalid actions (else the criterion is reward-only there)."""
    name: str
    env: str
    base_lr: float
    critic_lr: float
    micro: int
    iterations: int
    common: list
    describe: str
    counts_invalid: bool
    warm_start_iterations: int = 20
    copy_warm_start_lr: float = 1e-3  # the supervised warm start's (copy and gpu tiers)


TOY = Tier("toy", "stppo/Toy-v0", 3e-3, 3e-3, 16, 160,
           ["env_kwargs.fixed_target=null", "rollout.prompts_per_iteration=8", "rollout.samples_per_prompt=4",
            "rollout.max_turns=2",
            "rollout.max_new_tokens_per_turn=3", "rollout.max_prompt_tokens=8", "rollout.max_total_tokens=32",
            "monitor.probe_every=4",
            "monitor.probe_prompts=16", *SHARED],
           "stppo/Toy-v0 (2 turns, 3 new tokens per turn, the env reads the first word; the target is drawn per "
           "prompt from its 4 colours, one per GRPO group; a random policy earns 0.25), tiny random Llama "
           "(hidden 32, 2 layers, 9-token vocabulary), warm start: ppo at lag0 for 20 iterations from the random "
           "model, 8 prompts x 4 samples = 32 trajectories per iteration, probe of 16 prompts every 4 iterations, "
           "float32", False)
COPY = Tier("copy", "stppo/Copy-v0", 3e-4, 3e-3, 16, 160,
            ["rollout.prompts_per_iteration=8", "rollout.samples_per_prompt=4", "rollout.max_turns=2",
             "rollout.max_new_tokens_per_turn=16",
             "rollout.max_observation_tokens=17", "rollout.max_prompt_tokens=17", "rollout.max_total_tokens=80",
             "monitor.probe_every=4",
             "monitor.probe_prompts=16", *SHARED],
            "stppo/Copy-v0 (repeat 16 of 64 symbols per turn, 2 turns, partial credit per position: a random policy "
            "earns about 1/64; invalid actions counted), tiny Llama (hidden 64, 2 layers, 67-token word "
            "vocabulary) taught to copy to a sampled accuracy of 0.4, then ppo at lag0 for 10 iterations, 8 "
            "prompts x 4 samples = 32 trajectories per iteration, probe of 16 prompts every 4 iterations, float32",
            True, warm_start_iterations=10)
DEMO = Tier("demo", stability.STUDY_ENV, 1e-5, 1e-5, 4, 4, [*SHARED],
            "demo set (NQ-, HotpotQA-, MedQA-like; BM25), SmolLM2-135M-Instruct after stability.py's warm start "
            "(or --model), benchmarks/stability.py's regime: 8 prompts x 4 samples = 32 trajectories of up to 3 "
            "turns, 48 new tokens per turn, bfloat16 autocast forwards; held-out: 16 questions per family, greedy",
            True, warm_start_iterations=0)
GPU = Tier("gpu", "stppo/Copy-v0", 1e-5, 1e-5, 8, 200,
           ["rollout.prompts_per_iteration=8", "rollout.samples_per_prompt=4", "rollout.max_turns=2",
            "rollout.max_new_tokens_per_turn=64",
            "rollout.max_observation_tokens=64", "rollout.max_prompt_tokens=256", "rollout.max_total_tokens=512",
            "precision.autocast_dtype=bfloat16",
            "monitor.probe_every=10", "monitor.probe_prompts=32", *SHARED],
           "stppo/Copy-v0 (16 of 64 symbols per turn, 2 turns) with a real model (--model) taught to copy to a "
           "sampled accuracy of 0.4, then ppo at lag0 for 10 iterations, 32 trajectories per iteration, bfloat16 "
           "autocast forwards, probe of 32 prompts every 10 iterations", True, warm_start_iterations=10,
           copy_warm_start_lr=2e-5)
TIERS = {t.name: t for t in (TOY, COPY, DEMO, GPU)}
