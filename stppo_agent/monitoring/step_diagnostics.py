"""Per-optimizer-step diagnostics of a PPO-family update.

Within one iteration the first mini-batch of the first epoch is *on-policy* when the ratio's denominator is the
actor's own weights as the learner computes them (``stppo_agent.training.ppo_update.starts_on_policy``): the
actor has not moved since the old log-probs were taken, so every ratio is 1 up to rounding and nothing is clipped.
It is not when a lagged generator's log-probs are the denominator (``rollout.staleness`` with the coupled
objective: pi / pi_{i-K}) or the sampler's own ones with a precision gap (``rollout.old_logprobs=sampler`` with a
bfloat16 sampler or vLLM). Every later step is *off-policy*. That is where token- and turn-level clipping differ and
where the clip-bias correction acts, so the iteration means are also given over the off-policy steps alone
(``offpolicy/...``, :class:`stppo_agent.algorithms.metrics.StepMeans`): averaged with an on-policy step they are
diluted, and with one on-policy mini-batch per iteration they do not exist.

:class:`StepDiagnostics` (``logging.step_diagnostics=true``; on by default in ``stppo replay``) writes one record per
optimizer step to ``steps.jsonl``:

    iteration, step (optimizer steps so far), minibatch (0-based within the iteration), on_policy,
    grad_cos_to_first   cosine between this step's actor gradient and the iteration's first one, when that one was
                        on-policy (absent in iterations without an on-policy step: there is no reference)
    ratio_max/p99/min   token ratios exp(logp - old_logp) over policy tokens
    turn_ratio_max/p99/min  turn ratios: exp of the mean token log-ratio of each (trajectory, turn)
    token_outside_frac, turn_outside_frac   share of policy tokens / of turns whose token / turn ratio left
                        [1 - clip_low, 1 + clip_high], whatever the algorithm's ratio level: what token-level
                        and turn-level PPO would clip here, up to the sign of the advantage
    clip_frac, turn_clip_frac, dual_clip_frac (with algorithm.clip_ratio_c), ratio/ess (the effective sample size
    of the ratios at the algorithm's level), clip_bias_norm (||C||, measured for every algorithm),
    clip_bias_scale and clip_bias_changed (ST-PPO / S-PPO only), grad_norm, pg_grad_norm
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from stppo_agent.algorithms import AlgorithmConfig
from stppo_agent.algorithms.segments import quantile, segment_counts, segment_sum, turn_segment_ids
from stppo_agent.distributed import process_group
from stppo_agent.runs.metrics_log import json_value

# the loss and update metrics each steps.jsonl record repeats
RECORDED_KEYS = ("clip_frac", "turn_clip_frac", "dual_clip_frac", "ratio/ess", "clip_bias_norm", "clip_bias_scale",
                 "clip_bias_changed", "grad_norm", "pg_grad_norm")


class StepDiagnostics:
    """Collects what one optimizer step saw (``observe_micro`` for each micro-batch) and, before the optimizer
    moves the weights, measures the gradient (``finish_step``). The tails are exact over the whole global
    mini-batch: under data parallelism every rank's ratios are gathered (a collective in ``finish_step``), so
    every rank logs, and the collapse monitor on every rank judges, the same values."""

    def __init__(self, path: Path | None, sharded: bool = False, start_iteration: int = 0,
                 clip_low: float = 0.2, clip_high: float = 0.2, gradients: bool = True):
        """``path`` None: nothing is written (the tails still go into the iteration means, for the collapse
        monitor); ``gradients`` False: no gradient cosine (it copies every gradient once per step)."""
        self.path, self.sharded, self.gradients = path, sharded, gradients
        # CISPO's clip_low may be 1 (no lower bound): its log is -inf, which no ratio falls below
        self.log_low = math.log(1 - clip_low) if clip_low < 1 else -math.inf
        self.log_high = math.log1p(clip_high)
        self.iteration, self.minibatch, self.reference, self.on_policy_start = 0, 0, None, True
        self.token_log_ratios: list[torch.Tensor] = []
        self.turn_log_ratios: list[torch.Tensor] = []
        if path is not None and path.exists():  # on resume: drop the steps of iterations that will be redone
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and _iteration_of(line) <= start_iteration]
            path.write_text("".join(line + "\n" for line in kept))

    @classmethod
    def for_run(cls, run_dir: Path, algo: AlgorithmConfig, *, step_diagnostics: bool, on_collapse: str,
                sharded: bool = False, iteration: int = 0) -> "StepDiagnostics | None":
        """Full diagnostics with ``logging.step_diagnostics`` (written to ``run_dir/steps.jsonl``, continuing after
        ``iteration``); the ratio tails alone when only the collapse monitor (``monitor.on_collapse``) needs them; None
        when neither is on."""
        if not step_diagnostics and on_collapse == "none":
            return None
        return cls(run_dir / "steps.jsonl" if step_diagnostics else None, sharded, iteration, algo.clip_low,
                   algo.clip_high, gradients=step_diagnostics)

    def begin_iteration(self, iteration: int, on_policy_start: bool = True) -> None:
        """``on_policy_start``: whether the iteration's first step is on-policy (the gradient reference)."""
        self.iteration, self.minibatch, self.reference = iteration, 0, None
        self.on_policy_start = on_policy_start
        self.discard_step()

    def discard_step(self) -> None:
        """Forget what a step observed without finishing it (a skipped, non-finite step): its ratios belong to no
        applied step, and left in place they were counted in the next one's tails."""
        self.token_log_ratios, self.turn_log_ratios = [], []

    @torch.no_grad()
    def observe_micro(self, micro, logprobs: torch.Tensor) -> None:
        mask = micro.loss_mask
        log_ratio = torch.where(mask, logprobs.detach().float() - micro.old_logprobs.float(),
                                torch.zeros((), device=logprobs.device))
        self.token_log_ratios.append(log_ratio[mask].cpu())
        ids, segments = turn_segment_ids(micro.turn_ids, mask)
        counts = segment_counts(ids, segments, mask, log_ratio.dtype)
        sums = segment_sum(log_ratio, ids, segments)
        present = counts > 0
        self.turn_log_ratios.append((sums[present] / counts[present]).cpu())

    @torch.no_grad()
    def finish_step(self, parameters: list[torch.nn.Parameter], metrics: dict[str, float],
                    optimizer_steps: int) -> dict[str, float]:
        """Record this step; returns the diagnostics that also go into the iteration means."""
        tails = self._tails()
        out: dict[str, float] = {f"tail/{key}": value for key, value in tails.items()}
        on_policy = self.minibatch == 0 and self.on_policy_start
        record = {"iteration": self.iteration, "step": optimizer_steps + 1, "minibatch": self.minibatch,
                  "on_policy": on_policy, **tails}
        if self.gradients and (on_policy or self.reference is not None):
            flat = torch.cat([process_group.local_tensor(p.grad).reshape(-1).float() if p.grad is not None
                              else torch.zeros(process_group.local_tensor(p).numel(), device=p.device)
                              for p in parameters])
            if self.reference is None:
                self.reference = flat.clone()
            out["grad_cos_to_first"] = record["grad_cos_to_first"] = self._cosine(flat, self.reference)
        for key in RECORDED_KEYS:
            if key in metrics:
                record[key] = metrics[key]
        if self.path is not None and process_group.is_main():
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({k: json_value(v) for k, v in record.items()}) + "\n")
        self.minibatch += 1
        self.token_log_ratios, self.turn_log_ratios = [], []
        return out

    def _cosine(self, a: torch.Tensor, b: torch.Tensor) -> float:
        sums = torch.stack([(a.double() * b.double()).sum(), (a.double() ** 2).sum(), (b.double() ** 2).sum()])
        if self.sharded:  # each rank holds a disjoint shard of every gradient
            sums = process_group.all_reduce_sum(sums)
        dot, aa, bb = sums.tolist()
        return dot / math.sqrt(aa * bb) if aa > 0 and bb > 0 else 0.0

    def _tails(self) -> dict[str, float]:
        out = {}
        local = [torch.cat(parts) if parts else torch.zeros(0) for parts in (self.token_log_ratios,
                                                                            self.turn_log_ratios)]
        if process_group.world_size() > 1:  # quantiles and shares of the global mini-batch need every rank's values
            everyone = process_group.all_gather_objects(local)
            local = [torch.cat([rank_values[i] for rank_values in everyone]) for i in range(2)]
        for name, values in zip(("ratio", "turn_ratio"), local):
            if values.numel():
                out[f"{name}_max"] = math.exp(float(values.max()))
                out[f"{name}_p99"] = math.exp(quantile(values, 0.99))
                out[f"{name}_min"] = math.exp(float(values.min()))
                outside = (values > self.log_high) | (values < self.log_low)
                out[f"{'token' if name == 'ratio' else 'turn'}_outside_frac"] = float(outside.double().mean())
        return out


def _iteration_of(line: str) -> int:
    try:
        return int(json.loads(line).get("iteration", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return 1 << 62  # a torn line, or one that is not an object: dropped
