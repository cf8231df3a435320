"""Benchmark an algorithm of your own against ppo and st_ppo on the same env and budget.

    python examples/custom_algorithm.py [--model PATH] [--env stppo/Toy-v0] [--iterations 15]

The new algorithm is registered from this file -- no edit of the package: a dual-clip PPO loss (Ye et al.,
2020: also bound the loss of negative-advantage tokens whose ratio explodes) on turn-level ratios. Without
``--model`` the built-in tiny random model (``stppo train --model tiny``) is used, and the toy env shows the
learning curves in a minute on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import torch

from stppo_agent.algorithms import (
    ALGORITHMS,
    Hyperparameter,
    get_policy_loss,
    register_algorithm,
    register_policy_loss,
)
from stppo_agent.models.default_model import resolve_model
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.config_sections import LoggingConfig, OptimizerConfig, RolloutConfig
from stppo_agent.training.trainer import Trainer


@register_policy_loss("dual_clip", reads=("ratio_level", "clip_low", "clip_high"),
                      hyperparameters=[Hyperparameter("dual_clip_c", 3.0, "cap -c * A on the loss of A < 0 tokens")])
def dual_clip_loss(*, logprobs, old_logprobs, advantages, loss_mask, turn_ids, config, **kwargs):
    """PPO's clipped surrogate, then for A < 0 the loss is capped at -c * A (so one huge ratio cannot dominate);
    c is the rule's own hyper-parameter (``--set algorithm.dual_clip_c=5``)."""
    dual_clip_c = config.hyperparameter("dual_clip_c")
    loss, bias, metrics = get_policy_loss("ppo_clip")(logprobs=logprobs, old_logprobs=old_logprobs,
                                                      advantages=advantages, loss_mask=loss_mask, turn_ids=turn_ids,
                                                      config=config, **kwargs)
    ratio = torch.exp(logprobs - old_logprobs)
    capped = loss_mask & (advantages < 0) & (ratio > dual_clip_c)
    metrics["dual_clip_frac"] = (capped.sum() / loss_mask.sum().clamp(min=1)).detach()
    # below the cap the surrogate equals ppo_clip's; above it the gradient of those tokens is removed
    correction = torch.where(capped, ratio * advantages - dual_clip_c * advantages, torch.zeros_like(ratio))
    return loss + correction.sum() / loss_mask.sum().clamp(min=1), bias, metrics


register_algorithm(dataclasses.replace(ALGORITHMS["turn_ppo"], name="dual_clip_turn_ppo", policy_loss="dual_clip"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--env", default="stppo/Toy-v0")
    parser.add_argument("--iterations", type=int, default=15)
    args = parser.parse_args()
    model = args.model or resolve_model("tiny")  # the built-in random Llama of `--model tiny`
    toy = args.env == "stppo/Toy-v0"
    curves = {}
    for algo in ("ppo", "st_ppo", "dual_clip_turn_ppo"):
        out = tempfile.mkdtemp(prefix=f"{algo}-")
        config = TrainConfig(algo=algo, env=args.env, model=model, output_dir=out, iterations=args.iterations, seed=0,
                             algorithm={"kl_in_reward": 0.0},
                             rollout=RolloutConfig(prompts_per_iteration=8, samples_per_prompt=4,
                                                   max_turns=2 if toy else 4, max_new_tokens_per_turn=1 if toy else 256,
                                                   max_prompt_tokens=8 if toy else 1024,
                                                   max_total_tokens=32 if toy else 4096),
                             optimizer=OptimizerConfig(mini_batch_size=16, micro_batch_size=16, epochs=2,
                                                       actor_lr=3e-3 if toy else 1e-6, critic_lr=3e-3 if toy else 1e-5),
                             logging=LoggingConfig(progress=False, tensorboard=False))
        Trainer(config, report=lambda _: None).train()
        curves[algo] = [r["reward"] for r in read_metrics(out)]
    print(f"{'iteration':>9s} " + " ".join(f"{a:>20s}" for a in curves))
    for i in range(args.iterations):
        print(f"{i + 1:9d} " + " ".join(f"{curves[a][i]:20.3f}" for a in curves))


if __name__ == "__main__":
    main()
