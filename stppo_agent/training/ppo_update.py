"""The PPO update of one iteration: epochs over shuffled global mini-batches, gradient accumulation over
micro-batches, the clip-bias correction, gradient clipping, optimizer steps, and skipping (then stopping on)
non-finite steps. It steps the optimizers of a :class:`~stppo_agent.training.state.TrainingState` and counts in it
(optimizer steps, NaN skips)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import torch

from stppo_agent.algorithms import (
    WHOLE_BATCH_STATISTICS,
    AlgorithmConfig,
    ClipBiasCorrector,
    call_policy_loss,
    get_policy_loss,
    learner_kl_metrics,
    policy_token_mask,
    value_loss,
)
from stppo_agent.algorithms.clip_bias import changed_update
from stppo_agent.algorithms.metrics import StepMeans, StepMetrics
from stppo_agent.distributed import process_group
from stppo_agent.monitoring.step_diagnostics import StepDiagnostics
from stppo_agent.rollouts.batch import RolloutBatch
from stppo_agent.rollouts.global_batch import gather_global_batch, mini_batch_rows
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.log_probs import critic_values, length_sorted_micro_batches, token_logprobs
from stppo_agent.training.scoring import finish_scoring
from stppo_agent.training.stale_policy import is_decoupled
from stppo_agent.training.state import TrainingState


class TrainingDivergedError(RuntimeError):
    """Too many consecutive updates had NaN/inf losses or gradients."""


def starts_on_policy(config: TrainConfig, lag: int, sampled_by_actor: bool = True) -> bool:
    """Whether an iteration's first optimizer step is on-policy: the ratio's denominator is the actor's own
    weights as the learner computes them, so every ratio is 1 up to rounding and nothing is clipped. Recomputed
    log-probs (old_logprobs=recompute) are the actor's unless a lagged generator's weights take their place
    (rollout_staleness with the coupled objective; the decoupled one recomputes with the current weights and puts
    the lag into a separate behaviour weight). The sampler's own log-probs (old_logprobs=sampler) are the actor's
    only with no lag, a sampler that computes as the learner does (transformers generate without
    generation_autocast_dtype: not vLLM, not a bfloat16 sampler) and batches this rule sampled (a replay through
    another rule says otherwise: ``sampled_by_actor`` on its rollout source). ``lag``: updates between the weights
    that sampled the batch and the actor's."""
    lagged = lag > 0
    if config.rollout.old_logprobs == "recompute":
        return not lagged or config.rollout.stale_objective == "decoupled"
    same_precision = config.rollout.backend == "hf" and config.precision.generation_autocast_dtype is None
    return not lagged and same_precision and sampled_by_actor


def denominator_from_update(batch: RolloutBatch, total_steps: int, world: int) -> bool:
    """Whether scoring left the ratio's denominator to the update's forward (raises where it cannot be)."""
    if batch.old_logprobs is not None:
        return False
    if total_steps != 1 or world != 1:
        raise ValueError(f"old log-probs can come from the update's own forward only when it is one optimizer step "
                         f"in one process (scoring.old_logprobs_from_update), not {total_steps} steps in {world} "
                         "process(es)")
    return True


def take_denominator_from(mini: RolloutBatch, rows: torch.Tensor, batch: RolloutBatch, algo: AlgorithmConfig) -> None:
    """The denominators the update's forward gave ``mini`` (the batch's ``rows``, in a permuted order) back in the
    batch's own row order, then the mismatch statistics scoring left."""
    batch.old_logprobs = torch.zeros(batch.loss_mask.shape, dtype=torch.float32, device=mini.old_logprobs.device)
    batch.old_logprobs[rows.to(mini.old_logprobs.device)] = mini.old_logprobs
    finish_scoring(batch, algo)


class PPOUpdate:
    """The update of one iteration on a scored batch: steps ``state``'s models and optimizers and counts its
    optimizer steps and skips. ``rank`` / ``world``: this process's place among those sharing the global batch;
    ``sharded``: FSDP2 models; ``diagnostics``: per-step ratio tails and gradients (None: off); ``report`` / ``phase``:
    skip notices and progress; ``run_dir``: named when non-finite steps stop the run."""

    def __init__(self, state: TrainingState, config: TrainConfig, algo: AlgorithmConfig, *,
                 device: torch.device = torch.device("cpu"), rank: int = 0, world: int = 1, sharded: bool = False,
                 diagnostics: StepDiagnostics | None = None, run_dir: Path = Path("."),
                 report: Callable[[str], None] = print, phase: Callable[[str], None] = lambda text: None):
        self.state, self.config, self.algo = state, config, algo
        self.device, self.rank, self.world, self.sharded = device, rank, world, sharded
        self.diagnostics, self.run_dir, self.report, self.phase = diagnostics, run_dir, report, phase
        self.last_lr: float | None = None  # the learning rate of the last applied actor step

    def update(self, batch: RolloutBatch, on_policy_start: bool = True) -> dict[str, float]:
        """PPO epochs over this rank's scored share of the batch; returns the iteration's update metrics.
        ``on_policy_start``: whether the first step is on-policy (:func:`starts_on_policy`). The mini-batches are
        global: with several processes every rank gathers the global batch and takes its rows of each global
        mini-batch (:mod:`stppo_agent.rollouts.global_batch`), so the steps are those of one process on the global
        batch."""
        state, config = self.state, self.config
        means = StepMeans()
        tokens, started = 0, time.perf_counter()
        generator = torch.Generator().manual_seed(config.seed + state.iteration)
        if self.diagnostics is not None:
            self.diagnostics.begin_iteration(state.iteration + 1, on_policy_start)
        self.last_lr = None
        if self.world > 1:
            batch = gather_global_batch(batch, state.tokenizer.pad_token_id)
        size = config.optimizer.mini_batch_size
        total_steps, step, skipped = config.optimizer.epochs * math.ceil(batch.batch_size / size), 0, 0
        filled = denominator_from_update(batch, total_steps, self.world)
        for epoch in range(config.optimizer.epochs):
            order = torch.randperm(batch.batch_size, generator=generator)
            for start in range(0, batch.batch_size, size):
                rows = mini_batch_rows(order, start, size, self.rank, self.world)
                mini = batch.select(rows)
                step += 1
                self.phase(f"update step {step}/{total_steps}")
                step_metrics = self._optimizer_step(mini)
                if filled:
                    take_denominator_from(mini, rows, batch, self.algo)
                tokens += int(mini.loss_mask.sum())
                actor_stepped = math.isfinite(step_metrics["grad_norm"])  # what decides an actor skip
                if "skipped" in step_metrics:  # its NaN would make the iteration's means NaN: the monitor ignores
                    skipped += 1               # those, and was blind where the trouble began; it reads the count
                    step_metrics = {k: v for k, v in step_metrics.items() if k != "skipped" and math.isfinite(v)}
                means.add(step_metrics, on_policy=on_policy_start and epoch == 0 and start == 0,  # not moved yet
                          applied=actor_stepped)
        metrics = means.means()
        if skipped:  # a count (benchmarks/stability.py reads "skipped" > 0 as a collapse)
            metrics["skipped"] = skipped
        metrics["update_tokens_per_s"] = tokens / max(time.perf_counter() - started, 1e-9)
        metrics["nan_skips_total"] = state.nan_skips_total
        # the rate the iteration's last actor step used (the schedule has moved on to the next step's)
        metrics["actor_lr"] = self.last_lr if self.last_lr is not None else state.actor_scheduler.get_last_lr()[0]
        return metrics

    def _optimizer_step(self, mini: RolloutBatch) -> dict[str, float]:
        """One actor (and critic) optimizer step over ``mini`` with gradient accumulation. ``monitor.max_nan_skips``
        counts these steps: one whose actor and critic both failed is one skipped update, and a critic that fails
        every step stops the run though the actor steps (counted per model, the actor's success reset the count
        before the critic's failure raised it, and a step where both failed counted twice)."""
        metrics = self._actor_step(mini)
        failed = ["actor"] if "skipped" in metrics else []
        if self.state.critic is not None:
            critic = self._critic_step(mini)
            failed += ["critic"] if "skipped" in critic else []
            metrics.update(critic)
        if failed:
            self._count_skip(" and ".join(failed))
        else:
            self.state.nan_skips_in_a_row = 0
        return metrics

    def _split(self, mini: RolloutBatch) -> list[tuple[torch.Tensor, RolloutBatch]]:
        """(rows of ``mini``, micro-batch) pairs: length-grouped, trimmed micro-batches."""
        return list(length_sorted_micro_batches(mini, self.config.optimizer.micro_batch_size))

    @staticmethod
    def _synced_last(micros: list[RolloutBatch], ddp_module: torch.nn.Module | None = None):
        """``micros`` one by one; under DDP, gradients are all-reduced only after the last one."""
        for number, micro in enumerate(micros):
            last = number == len(micros) - 1
            if ddp_module is not None and hasattr(ddp_module, "no_sync") and not last:
                with ddp_module.no_sync():
                    yield micro
            else:
                yield micro

    def _global_counts(self, mini: RolloutBatch, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy tokens (those of ``mask``, default ``mini.loss_mask``) and trajectories of the *global* mini-batch,
        divided by the number of ranks: DDP averages gradients over ranks, so each rank normalises by global / world
        to get the global mean."""
        mask = mini.loss_mask if mask is None else mask
        counts = torch.stack([mask.sum(), mask.any(1).sum()]).float()
        tokens, seqs = process_group.all_reduce_sum(counts) / self.world
        return tokens.clamp(min=1 / self.world), seqs.clamp(min=1 / self.world)

    def actor_gradients(self, mini: RolloutBatch) -> dict[str, float]:
        """Fill the actor's ``.grad`` for one optimizer step over ``mini`` (clip-bias correction and gradient
        clipping included) and return the step's metrics; ``grad_norm`` is NaN when the step must be skipped."""
        state, config = self.state, self.config
        algo, loss_fn = self.algo, get_policy_loss(self.algo.policy_loss)
        params = [p for p in state.actor.parameters() if p.requires_grad]
        # With step diagnostics, ||C|| is measured for every algorithm (only S-PPO / ST-PPO rescale by it).
        corrector = ClipBiasCorrector(params, algo.clip_bias_kappa, through_grad=self.sharded,
                                      rescale=algo.clip_bias_correction) \
            if algo.clip_bias_correction or config.logging.step_diagnostics else None
        # tokens of weight 0 (masked by the rollout correction, DAPO's fillers) count in no denominator
        global_tokens, global_seqs = self._global_counts(mini, policy_token_mask(mini.loss_mask, mini.token_weights))
        state.actor_optimizer.zero_grad(set_to_none=True)
        rows, micros = zip(*self._split(mini))
        # No denominator yet (scoring.old_logprobs_from_update): each micro-batch's forward below gives its own,
        # detached, and ``mini`` collects them for what reads them after the update.
        fill = mini.old_logprobs is None
        if fill:
            mini.old_logprobs = torch.zeros(mini.loss_mask.shape, dtype=torch.float32, device=mini.loss_mask.device)
        whole_batch = self._whole_batch_keywords(list(micros))
        step_metrics = StepMetrics()
        finite = torch.ones((), device=self.device)
        for number, micro in enumerate(self._synced_last(micros, state.actor_train)):
            logprobs, entropy = token_logprobs(state.actor_train, micro, with_entropy=True,
                                               entropy_grad=algo.entropy_coef > 0, sampling=config.sampling())
            if fill:
                micro.old_logprobs = logprobs.detach()
                mini.old_logprobs[rows[number].to(logprobs.device), :logprobs.shape[1]] = micro.old_logprobs
            loss, bias, metrics = call_policy_loss(
                loss_fn, logprobs=logprobs, old_logprobs=micro.old_logprobs, advantages=micro.advantages,
                loss_mask=micro.loss_mask, turn_ids=micro.turn_ids, config=algo,
                ref_logprobs=micro.ref_logprobs if algo.kl_loss_coef > 0 else None, entropy=entropy,
                global_num_tokens=global_tokens, global_num_seqs=global_seqs, token_weights=micro.token_weights,
                **whole_batch[number])
            finite = finite * torch.isfinite(loss)
            if self.diagnostics is not None:
                self.diagnostics.observe_micro(micro, logprobs)
            if corrector is not None:
                corrector.accumulate(bias, anchor=logprobs)
            loss.backward()  # always, even when NaN: every rank must join DDP's all-reduce; NaN then skips
            step_metrics.add(metrics, micro.loss_mask.sum())
            if micro.ref_logprobs is not None:  # free: the forward above computed the learner's log-probs
                step_metrics.add(learner_kl_metrics(logprobs, micro.ref_logprobs, micro.loss_mask),
                                 micro.loss_mask.sum())
        out = step_metrics.reduce()
        scale = None
        if corrector is not None:
            corrector.all_reduce()
            measured = corrector.measure()
            scale = measured.get("clip_bias_scale")
            out.update({k: float(v) for k, v in measured.items()})
        after = algo.clip_bias_order == "after_grad_clip"
        if scale is not None and not after:
            corrector.scale_gradients(scale)
        max_norm = config.optimizer.max_grad_norm
        grad_norm = process_group.clip_grad_norm(params, max_norm)  # the norm it saw, before clipping
        if scale is not None and after:
            corrector.scale_gradients(scale)
        if scale is not None:  # 1 where the gradient handed to the optimizer differs from PPO's
            out["clip_bias_changed"] = float(changed_update(out["clip_bias_scale"], out["pg_grad_norm"], max_norm,
                                                            algo.clip_bias_order))
        ok = bool(process_group.all_reduce_sum(finite) == self.world) and bool(torch.isfinite(grad_norm))
        out["grad_norm"] = float(grad_norm) if ok else math.nan
        return out

    def _whole_batch_keywords(self, micros: list[RolloutBatch]) -> list[dict]:
        """Per micro-batch, the extra keywords of a loss whose mask is a statistic of the whole optimizer batch
        (M2PO), from a no-grad forward over every micro-batch with the weights the step starts from; none for the
        other losses, or when this rank's share is one micro-batch (the loss's own statistic spans it then). Under
        the decoupled objective the statistic is taken on the proximal policy against the behaviour one (AReaL's
        pair: ``old_logprobs`` against ``sample_logprobs``), which needs no forward.
        Ranks hold equally many micro-batches, so they agree on whether to take the collective inside."""
        statistic = WHOLE_BATCH_STATISTICS.get(self.algo.policy_loss)
        decoupled = is_decoupled(self.config)
        if statistic is None or (len(micros) == 1 and not decoupled):
            return [{} for _ in micros]
        if decoupled:
            numerators, denominators = [m.old_logprobs for m in micros], [m.sample_logprobs for m in micros]
        else:
            with torch.no_grad():
                numerators = [token_logprobs(self.state.actor_train, micro, sampling=self.config.sampling())[0]
                              for micro in micros]
            denominators = [micro.old_logprobs if micro.old_logprobs is not None else numerator  # the same weights
                            for micro, numerator in zip(micros, numerators)]
        return statistic(logprobs=numerators, old_logprobs=denominators,
                         loss_mask=[policy_token_mask(m.loss_mask, m.token_weights) for m in micros],
                         turn_ids=[micro.turn_ids for micro in micros], config=self.algo)

    def _actor_step(self, mini: RolloutBatch) -> dict[str, float]:
        state = self.state
        out = self.actor_gradients(mini)
        if not math.isfinite(out["grad_norm"]):
            if self.diagnostics is not None:  # its ratios would otherwise count in the next step's tails
                self.diagnostics.discard_step()
            return self._skip_step(out, "actor")
        if self.diagnostics is not None:  # the gradient the optimizer is about to apply
            params = [p for p in state.actor.parameters() if p.requires_grad]
            out.update(self.diagnostics.finish_step(params, out, state.optimizer_steps))
        self.last_lr = state.actor_optimizer.param_groups[0]["lr"]
        state.actor_optimizer.step()
        state.actor_scheduler.step()
        state.optimizer_steps += 1
        return out

    def _skip_step(self, metrics: dict[str, float], which: str) -> dict[str, float]:
        """Drop the step's gradient; of its metrics keep only the gradient norm that shows why: a loss can be
        finite where the gradient is not, and its pg_loss, clip_frac, ... describe no applied step."""
        optimizer = self.state.actor_optimizer if which == "actor" else self.state.critic_optimizer
        optimizer.zero_grad(set_to_none=True)
        norm = "grad_norm" if which == "actor" else "critic_grad_norm"
        return {"skipped": 1.0, norm: metrics[norm]}

    def _count_skip(self, which: str) -> None:
        state = self.state
        state.nan_skips_in_a_row += 1
        state.nan_skips_total += 1
        if process_group.is_main():  # every rank skips alike (the non-finite check is global); one says so
            self.report(f"iteration {state.iteration + 1}: non-finite {which} loss or gradient; update skipped "
                        f"({state.nan_skips_in_a_row} in a row)")
        if state.nan_skips_in_a_row > self.config.monitor.max_nan_skips:
            raise TrainingDivergedError(
                f"{state.nan_skips_in_a_row} consecutive updates had NaN/inf losses or gradients; stopping. "
                f"Checkpoints are in {self.run_dir / 'checkpoints'}; the newest may hold the weights that diverged "
                "(a skipped update keeps the last finite weights, not healthy ones). Lower the learning rate, raise "
                "optimizer.max_grad_norm headroom, or check the data and rewards, then --resume, or start a new run "
                "from an earlier checkpoint's actor (--model RUN/checkpoints/step-N/actor).")

    def _critic_step(self, mini: RolloutBatch) -> dict[str, float]:
        state = self.state
        global_tokens, _ = self._global_counts(mini)
        state.critic_optimizer.zero_grad(set_to_none=True)
        step_metrics = StepMetrics()
        finite = torch.ones((), device=self.device)
        for micro in self._synced_last([micro for _, micro in self._split(mini)], state.critic_train):
            values = critic_values(state.critic_train, micro)
            loss, metrics = value_loss(values=values, old_values=micro.values, returns=micro.returns,
                                       loss_mask=micro.loss_mask, config=self.algo, global_num_tokens=global_tokens)
            finite = finite * torch.isfinite(loss)
            loss.backward()
            step_metrics.add(metrics, micro.loss_mask.sum())
        totals = step_metrics.reduce()
        grad_norm = process_group.clip_grad_norm(list(state.critic.parameters()), self.config.optimizer.max_grad_norm)
        totals["critic_grad_norm"] = float(grad_norm)
        all_finite = bool(process_group.all_reduce_sum(finite) == self.world)
        if not (all_finite and math.isfinite(totals["critic_grad_norm"])):
            return self._skip_step(dict(totals), "critic")
        state.critic_optimizer.step()
        state.critic_scheduler.step()
        return dict(totals)
