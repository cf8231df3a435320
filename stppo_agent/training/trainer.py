"""The PPO-family update loop. One iteration reads as its steps:

    batch = rollout()                      multi-turn episodes in the envs, token-in/token-out
    score(batch)                           old / reference log-probs, values, KL penalty, advantages
    update(batch)                          PPO epochs over shuffled mini-batches, gradient accumulation,
                                           clip-bias correction, gradient clipping, optimizer steps
    log + checkpoint                       metrics.jsonl / TensorBoard; atomic Hugging Face checkpoints
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
from stppo_agent.monitoring.collapse_guard import CollapseGuard, CollapseStopped, stop_advice
from stppo_agent.monitoring.step_diagnostics import StepDiagnostics
from stppo_agent.rollouts.batch import RolloutBatch
from stppo_agent.rollouts.statistics import rollout_statistics
from stppo_agent.runs import run_folder, trainer_state
from stppo_agent.runs.checkpoint import full_model_state, save_checkpoint
from stppo_agent.runs.metrics_log import MetricsLogger
from stppo_agent.runs.recording import RolloutRecorder, drop_recordings_after
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.live_rollouts import LiveRollouts
from stppo_agent.training.model_setup import build_models
from stppo_agent.training.ppo_update import PPOUpdate
from stppo_agent.training.probe import LearnerProbe
from stppo_agent.training.scoring import score_batch
from stppo_agent.training.training_split import with_training_split


class Trainer:
    """Trains ``config.model`` on ``config.env`` with ``config.algo``; ``resume=True`` continues a run."""

    def __init__(self, config: TrainConfig, resume: bool = False, report: Callable[[str], None] = print,
                 batch_hook: Callable[[RolloutBatch], None] | None = None,
                 rollout_source: Callable[["Trainer"], Any] | None = None, overwrite: bool = False):
        """``rollout_source(trainer)`` builds where batches come from (default :class:`LiveRollouts`: play the
        envs now; ``stppo_agent.training.replay`` passes recorded batches). A folder that holds a run needs ``resume``
        or ``overwrite`` (:mod:`stppo_agent.runs.run_folder`)."""
        config.validate()
        self.device = resolve_device(config.device)
        config = with_resolved_precision(config, self.device)
        self.config, self.report, self.batch_hook = config, report, batch_hook
        self.algo = config.algorithm_config()
        self.run_dir = Path(config.output_dir)
        self.sharded = config.strategy == "fsdp2"
        if self.sharded:
            process_group.ensure_process_group()
        self.rank, self.world = process_group.rank(), process_group.world_size()
        if config.prompts_per_iteration % self.world or config.mini_batch_size % self.world:
            raise ValueError(f"prompts_per_iteration ({config.prompts_per_iteration}) and mini_batch_size "
                             f"({config.mini_batch_size}) must be multiples of the number of processes ({self.world})")
        self.iteration, self.optimizer_steps, self.nan_skips_in_a_row, self.nan_skips_total = 0, 0, 0, 0
        self.actor_lr_scale = 1.0  # the rollbacks' compounded learning-rate factor (saved in checkpoints)
        self._bar = None  # the progress bar while train() runs
        process_group.seed_everything(config.seed)  # the same on every rank: models are built identically
        checkpoint = run_folder.prepare_on_all_ranks(self.run_dir, resume=resume, overwrite=overwrite, report=report)
        self.config = config = with_training_split(
            config, trainer_state.checkpoint_config(checkpoint) if checkpoint is not None else None, report)
        trainer_state.check_resume_settings(self, checkpoint)  # a refused change fails before the models load
        build_models(self, checkpoint)
        self.updater = PPOUpdate(self)
        if self.rank > 0:  # each rank samples its own tokens; rank 0 continues the one-process stream unchanged
            process_group.seed_everything(process_group.rank_seed(config.seed, self.rank))
        self.source = (rollout_source or LiveRollouts)(self)
        self.probe = LearnerProbe.for_trainer(self)
        if checkpoint is not None:
            trainer_state.resume(self, checkpoint)
        self.logger = None
        if process_group.is_main():  # one process writes the run folder
            self.logger = MetricsLogger(self.run_dir, tensorboard=config.tensorboard,
                                        wandb_project=config.wandb_project, config=dataclasses.asdict(config))
            self.logger.truncate_after(self.iteration, report)
            (self.run_dir / "config.yaml").write_text(config.to_yaml(resolved=self.algo))
        if checkpoint is not None and process_group.is_main():
            drop_recordings_after(self.run_dir, self.iteration)
        self.recorder = RolloutRecorder.for_trainer(self) if config.save_rollouts else None
        self.diagnostics = StepDiagnostics.for_trainer(self)
        self.guard = CollapseGuard(self) if config.on_collapse != "none" else None

    # -- setup ---------------------------------------------------------------------------------------------
    # -- one iteration -----------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        bar = tqdm(total=self.config.iterations, initial=self.iteration, desc="training", unit="it",
                   disable=not (self.config.progress and process_group.is_main()))
        self._bar = bar
        metrics: dict[str, Any] = {}
        if self.iteration >= self.config.iterations:  # a resumed run that is already as long as asked
            self.report(f"nothing to train: {self.run_dir} is at iteration {self.iteration} and iterations="
                        f"{self.config.iterations}; --iterations {self.iteration + 1} or more continues it")
        try:
            while self.iteration < self.config.iterations:
                started = time.perf_counter()
                if self.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(self.device)
                batch = self.rollout()
                lag = self.stale_policy.lag  # updates between the weights that sampled the batch and the actor's
                rollout_seconds = time.perf_counter() - started
                self.phase("scoring")
                self.score(batch)
                metrics = self.update(batch)
                self.stale_policy.advance(self.actor)
                if hasattr(self.backend, "sync_weights"):  # an engine with its own copy of the weights
                    self.backend.sync_weights(self.actor)
                self.iteration += 1
                metrics.update(rollout_statistics(batch, self.algo), rollout_seconds=rollout_seconds,
                               iteration_seconds=time.perf_counter() - started,
                               rollout_tokens_per_s=float(batch.loss_mask.sum()) / max(rollout_seconds, 1e-9))
                if self.config.rollout_staleness:
                    metrics["staleness"] = lag
                if self.probe is not None and self.probe.due(self.iteration):  # the learner, not the lagged generator
                    metrics.update(self.probe.measure(self.actor, self.iteration, self.optimizer_steps))
                if self.device.type == "cuda":  # this rank's peak this iteration: shows what FSDP2 saves
                    metrics["gpu_peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
                decision = self.guard.check(self.iteration, metrics) if self.guard is not None else None
                if self.logger is not None:
                    self.logger.log(self.iteration, metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", tok_s=f"{metrics['update_tokens_per_s']:.0f}")
                if decision is not None or self.iteration % self.config.save_every == 0 \
                        or self.iteration == self.config.iterations:
                    path = self.save()  # a collapse's decision is saved at once: the alarm state, or the rollback
                    if decision is not None and decision.stops:
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

    def rollout(self) -> RolloutBatch:
        self.phase("rollout")
        batch = self.source.next_batch(self.iteration)
        if self.recorder is not None:  # as sampled: before any test hook or scoring touches it
            self.recorder.record(self.iteration + 1, batch)
        if self.batch_hook is not None:
            self.batch_hook(batch)
        return batch.to(self.device)

    def score(self, batch: RolloutBatch) -> None:
        score_batch(self, batch)
        from stppo_agent.monitoring.learning_signal import notice_no_learning_signal  # said once per run
        notice_no_learning_signal(self, batch)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        return self.updater.update(batch)

    def actor_gradients(self, mini: RolloutBatch) -> dict[str, float]:
        """Fill the actor's ``.grad`` for one optimizer step over ``mini``; see :class:`PPOUpdate`."""
        return self.updater.actor_gradients(mini)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Rank 0 writes one checkpoint of full tensors (gathered from FSDP2 shards)."""
        tensor_state, json_state = trainer_state.checkpoint_states(self)
        actor_state, critic_state = self.full_states()
        path = self.run_dir / "checkpoints" / f"step-{self.iteration}"
        if process_group.is_main():  # the full state dicts above live on rank 0 only (cpu_offload)
            path = save_checkpoint(self.run_dir, self.iteration, actor=self.actor, tokenizer=self.tokenizer,
                                   critic=self.critic, tensor_state=tensor_state, json_state=json_state,
                                   keep=self.config.keep_checkpoints, actor_state=actor_state,
                                   critic_state=critic_state,
                                   protect=self.guard.protected_steps() if self.guard is not None else ())
        process_group.barrier()
        return path

    def full_states(self) -> tuple[dict | None, dict | None]:
        """Full actor and critic state dicts gathered from FSDP2 shards (a collective); None, None unsharded."""
        if not self.sharded:
            return None, None
        return full_model_state(self.actor), full_model_state(self.critic) if self.critic is not None else None
