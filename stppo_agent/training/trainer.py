"""The PPO-family training loop. One iteration reads as its stages, each a function or small class that takes
what it needs and returns what it produced (docs/architecture.md draws the data flow):

    batch = rollout()                      multi-turn episodes in the envs, token-in/token-out (a rollout source)
    score(batch)                           old / reference log-probs, values, KL penalty, advantages (score_batch)
    metrics = update(batch)                PPO epochs over shuffled mini-batches, gradient accumulation,
                                           clip-bias correction, gradient clipping, optimizer steps (PPOUpdate)
    decision = guard.check(metrics)        the collapse monitor: continue, warn, stop or roll back to step N
    log + checkpoint                       metrics.jsonl / TensorBoard; atomic Hugging Face checkpoints

Everything an iteration changes lives in one :class:`~stppo_agent.training.state.TrainingState`, which checkpoints,
``--resume`` and a collapse rollback save and load.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import torch

import stppo_envs  # noqa: F401  (registers the env ids)
from stppo_agent.distributed import process_group
from stppo_agent.models.loading import resolve_device
from stppo_agent.models.precision import with_resolved_precision
from stppo_agent.monitoring.collapse_guard import CONTINUE, CollapseGuard, CollapseStopped, stop_advice
from stppo_agent.monitoring.learning_signal import LearningSignalNotice
from stppo_agent.monitoring.step_diagnostics import StepDiagnostics
from stppo_agent.rollouts.batch import RolloutBatch
from stppo_agent.rollouts.statistics import rollout_statistics
from stppo_agent.runs import run_folder, trainer_state
from stppo_agent.runs.metrics_log import MetricsLogger
from stppo_agent.runs.recording import RolloutRecorder, drop_recordings_after
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.live_rollouts import LiveRollouts, RolloutContext, RolloutSource
from stppo_agent.training.model_setup import build_state, generation_backend, weights_folder
from stppo_agent.training.ppo_update import PPOUpdate, starts_on_policy
from stppo_agent.training.probe import LearnerProbe
from stppo_agent.training.scoring import old_logprobs_from_update, score_batch
from stppo_agent.training.state import Restore
from stppo_agent.training.training_split import with_training_split


class Trainer:
    """Trains ``config.model`` on ``config.env`` with ``config.algo``; ``resume=True`` continues a run."""

    def __init__(self, config: TrainConfig, resume: bool = False, report: Callable[[str], None] = print,
                 batch_hook: Callable[[RolloutBatch], None] | None = None,
                 rollout_source: Callable[[RolloutContext], RolloutSource] | None = None, overwrite: bool = False):
        """``rollout_source(context)`` builds where batches come from (default :class:`LiveRollouts`: play the
        envs now; ``stppo_agent.training.replay`` passes recorded batches). A folder that holds a run needs ``resume``
        or ``overwrite`` (:mod:`stppo_agent.runs.run_folder`)."""
        config.validate()
        self.device = resolve_device(config.device)
        config = with_resolved_precision(config, self.device)
        self.config, self.report, self.batch_hook = config, report, batch_hook
        self.algo = config.algorithm_config()
        self.run_dir = Path(config.output_dir)
        self.sharded = config.distributed.strategy == "fsdp2"
        if self.sharded:
            process_group.ensure_process_group()
        self.rank, self.world = process_group.rank(), process_group.world_size()
        if config.rollout.prompts_per_iteration % self.world or config.optimizer.mini_batch_size % self.world:
            raise ValueError(f"rollout.prompts_per_iteration ({config.rollout.prompts_per_iteration}) and "
                             f"optimizer.mini_batch_size ({config.optimizer.mini_batch_size}) must be multiples of the "
                             f"number of processes ({self.world})")
        self._bar = None  # the progress bar while train() runs
        process_group.seed_everything(config.seed)  # the same on every rank: models are built identically
        checkpoint = run_folder.prepare_on_all_ranks(self.run_dir, resume=resume, overwrite=overwrite, report=report)
        self.config = config = with_training_split(
            config, trainer_state.checkpoint_config(checkpoint) if checkpoint is not None else None, report)
        # a refused change fails before the models load
        trainer_state.check_resume_settings(config, self.algo, checkpoint, report)
        self.state = state = build_state(config, self.algo, self.device, self.sharded, checkpoint, report)
        self.backend = generation_backend(config, state.stale_policy.model, state.tokenizer, self.rank,
                                          weights_folder(config, checkpoint))
        if self.rank > 0:  # each rank samples its own tokens; rank 0 continues the one-process stream unchanged
            process_group.seed_everything(process_group.rank_seed(config.seed, self.rank))
        self.source = (rollout_source or LiveRollouts)(RolloutContext(
            config, self.algo, self.run_dir, state.tokenizer, self.backend, self.rank, self.world, self.phase))
        state.sampler = self.source
        self.probe = LearnerProbe.for_run(config, state.tokenizer, self.source.env_kwargs)
        if checkpoint is not None:
            state.load(checkpoint, config, self.algo, Restore.RESUME, report)
        self.logger = None
        if process_group.is_main():  # one process writes the run folder
            self.logger = MetricsLogger(self.run_dir, tensorboard=config.logging.tensorboard,
                                        wandb_project=config.logging.wandb_project, config=dataclasses.asdict(config))
            self.logger.truncate_after(state.iteration, report)
            (self.run_dir / "config.yaml").write_text(config.to_yaml(resolved=self.algo))
        if checkpoint is not None and process_group.is_main():
            drop_recordings_after(self.run_dir, state.iteration)
        self.recorder = RolloutRecorder.for_run(
            self.run_dir, state.tokenizer, self.rank, self.world, iteration=state.iteration, actor=state.actor,
            critic=state.critic, critic_model=config.critic_model,
            full_states=lambda: state.full_states(self.sharded)) if config.logging.save_rollouts else None
        self.diagnostics = StepDiagnostics.for_run(self.run_dir, self.algo,
                                                   step_diagnostics=config.logging.step_diagnostics,
                                                   on_collapse=config.monitor.on_collapse, sharded=self.sharded,
                                                   iteration=state.iteration)
        self.guard = CollapseGuard(config, self.run_dir) if config.monitor.on_collapse != "none" else None
        self.updater = PPOUpdate(state, config, self.algo, device=self.device, rank=self.rank, world=self.world,
                                 sharded=self.sharded, diagnostics=self.diagnostics, run_dir=self.run_dir,
                                 report=report, phase=self.phase)
        self.learning_signal = LearningSignalNotice(config, self.algo, report, self.world, self.device)

    # -- the loop ----------------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        config, state = self.config, self.state
        bar = tqdm(total=config.iterations, initial=state.iteration, desc="training", unit="it",
                   disable=not (config.logging.progress and process_group.is_main()))
        self._bar = bar
        metrics: dict[str, Any] = {}
        if state.iteration >= config.iterations:  # a resumed run that is already as long as asked
            self.report(f"nothing to train: {self.run_dir} is at iteration {state.iteration} and iterations="
                        f"{config.iterations}; --iterations {state.iteration + 1} or more continues it")
        try:
            while state.iteration < config.iterations:
                started = time.perf_counter()
                if self.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(self.device)
                batch = self.rollout()
                lag = state.stale_policy.lag  # updates between the weights that sampled the batch and the actor's
                rollout_seconds = time.perf_counter() - started
                self.phase("scoring")
                if self.old_logprobs_from_update(batch):  # one step on the sampling weights: no scoring forward
                    self.score(batch, old_from_update=True)
                else:
                    self.score(batch)
                metrics = self.update(batch)
                state.stale_policy.advance(state.actor)
                self.backend.sync_weights(state.actor)  # an engine with its own copy of the weights takes them
                state.iteration += 1
                metrics.update(rollout_statistics(batch, self.algo), rollout_seconds=rollout_seconds,
                               iteration_seconds=time.perf_counter() - started,
                               rollout_tokens_per_s=float(batch.loss_mask.sum()) / max(rollout_seconds, 1e-9))
                metrics.update(self.measure(lag))
                decision = self.guard.check(state.iteration, metrics, state.actor_lr_scale) \
                    if self.guard is not None else CONTINUE
                if decision.alarmed and process_group.is_main():  # every rank decides alike; one says so
                    self.report(decision.reason)
                if decision.rolls_back:
                    metrics.update(self.roll_back(decision.rollback_to))
                self.log(metrics)
                if decision.alarmed or state.iteration % config.checkpoint.every == 0 \
                        or state.iteration == config.iterations:
                    path = self.save()  # a collapse's decision is saved at once: the alarm state, or the rollback
                    if decision.stops:
                        raise CollapseStopped(stop_advice(decision, path))
        finally:
            bar.close()
            self._bar = None
            if self.logger is not None:
                self.logger.close()
        return metrics

    def phase(self, text: str) -> None:
        """Progress within an iteration (minutes with a real model on a CPU): the training bar's postfix while
        train() runs, nothing otherwise."""
        if self._bar is not None and not self._bar.disable:
            self._bar.set_postfix_str(text, refresh=True)

    # -- the stages --------------------------------------------------------------------------------------------
    def rollout(self) -> RolloutBatch:
        self.phase("rollout")
        batch = self.source.next_batch(self.state.iteration)
        if self.recorder is not None:  # as sampled: before any test hook or scoring touches it
            self.recorder.record(self.state.iteration + 1, batch)
        if self.batch_hook is not None:
            self.batch_hook(batch)
        return batch.to(self.device)

    def old_logprobs_from_update(self, batch: RolloutBatch) -> bool:
        """Whether this batch's update can take the ratio's denominator from its own forward (one step on the
        sampling weights; :func:`~stppo_agent.training.scoring.old_logprobs_from_update`): the loop then scores
        without that forward."""
        state = self.state
        return old_logprobs_from_update(self.config, self.algo, batch_size=batch.batch_size,
                                        lag=state.stale_policy.lag, world=self.world, reference=state.reference)

    def score(self, batch: RolloutBatch, old_from_update: bool = False) -> None:
        """Scores ``batch`` for its update. ``old_from_update`` (what :meth:`old_logprobs_from_update` allows; the
        training loop asks for it): ``batch.old_logprobs`` stay None for the update's forward to fill in."""
        state = self.state
        score_batch(batch, config=self.config, algo=self.algo, actor=state.actor, generator=state.stale_policy.model,
                    reference=state.reference, critic=state.critic, device=self.device, world=self.world,
                    old_from_update=old_from_update)
        self.learning_signal.check(batch, state.iteration)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        on_policy = starts_on_policy(self.config, self.state.stale_policy.lag, self.source.sampled_by_actor)
        return self.updater.update(batch, on_policy)

    def actor_gradients(self, mini: RolloutBatch) -> dict[str, float]:
        """Fill the actor's ``.grad`` for one optimizer step over ``mini``; see :class:`PPOUpdate`."""
        return self.updater.actor_gradients(mini)

    def measure(self, lag: int) -> dict[str, float]:
        """What an iteration logs besides its rollouts and update: the lag, the learner probe, the peak memory."""
        state, out = self.state, {}
        if self.config.rollout.staleness:
            out["staleness"] = lag
        if self.probe is not None and self.probe.due(state.iteration):  # the learner, not the lagged generator
            out.update(self.probe.measure(state.actor, state.iteration, state.optimizer_steps))
        if self.device.type == "cuda":  # this rank's peak this iteration: shows what FSDP2 saves
            out["gpu_peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    def log(self, metrics: dict[str, Any]) -> None:
        if self.logger is not None:
            self.logger.log(self.state.iteration, metrics)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(reward=f"{metrics['reward']:.3f}", tok_s=f"{metrics['update_tokens_per_s']:.0f}")

    def roll_back(self, step: int) -> dict[str, float]:
        """Carry out a rollback decision: the weights, optimizers and lagged generator of ``step-{step}``, the actor's
        learning rate lowered by ``monitor.rollback_lr_factor`` (compounding: the checkpoint's own rate is not taken
        back); returns the ``collapse/...`` metrics that record it."""
        state = self.state
        state.actor_lr_scale *= self.config.monitor.rollback_lr_factor
        state.load(self.run_dir / "checkpoints" / f"step-{step}", self.config, self.algo, Restore.ROLLBACK,
                   self.report)
        self.backend.sync_weights(state.actor)  # an engine with its own copy of the weights (vLLM)
        state.nan_skips_in_a_row = 0  # the skips were the abandoned weights'; the restored ones start a new streak
        if self.guard is not None:
            self.guard.rolled_back(step)
        return {"collapse/rollback_to": step, "collapse/lr_scale": state.actor_lr_scale,
                "collapse/actor_lr": state.actor_scheduler.get_last_lr()[0]}

    def save(self) -> Path:
        """Checkpoint the state as ``checkpoints/step-{iteration}`` (every rank calls it: FSDP2 gathers)."""
        return self.state.save(self.run_dir, self.config, self.algo, sharded=self.sharded,
                               protect=self.guard.protected_steps() if self.guard is not None else ())
