"""The PPO-family update loop. One iteration reads as its steps:

    batch = rollout()                      multi-turn episodes in the envs, token-in/token-out
    score(batch)                           old / reference log-probs, values, KL penalty, advantages
    update(batch)                          PPO epochs over shuffled mini-batches, gradient accumulation,
                                           clip-bias correction, gradient clipping, optimizer steps
    log + checkpoint                       metrics.jsonl / TensorBoard; atomic Hugging Face checkpoints
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

import stppo_envs  # noqa: F401  (registers the env ids)

from . import distributed, run_folder, trainer_state
from .algorithms import (
    ClipBiasCorrector,
    get_advantage_estimator,
    get_policy_loss,
    kl_reward_penalty,
    rollout_correction_weights,
    value_loss,
)
from .checkpoint import full_model_state, save_checkpoint
from .collapse_guard import CollapseGuard, CollapseStopped, stop_advice
from .config import TrainConfig
from .diagnostics import StepDiagnostics, StepMeans
from .forward import batched_no_grad, critic_values, length_sorted_micro_batches, token_logprobs
from .global_batch import gather_global_batch, mini_batch_rows
from .live_rollouts import LiveRollouts, PromptSampler  # noqa: F401  (PromptSampler: kept importable from here)
from .logging_utils import MetricsLogger
from .mixed_precision import with_resolved_precision
from .models import DTYPES, load_policy_models, resolve_device
from .recording import RolloutRecorder
from .reduced_metrics import StepMetrics, rollout_statistics
from .rollout import HFGenerationBackend, RolloutBatch


class TrainingDivergedError(RuntimeError):
    """Too many consecutive updates had NaN/inf losses or gradients."""


def _disable_dropout(model: torch.nn.Module) -> None:
    """RL needs ratio == 1 on-policy: dropout would make the same tokens score differently on each pass."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, 0.0)


def _warmup(steps: int) -> Callable[[int], float]:
    return lambda step: min(1.0, (step + 1) / steps) if steps > 0 else 1.0


class Trainer:
    """Trains ``config.model`` on ``config.env`` with ``config.algo``; ``resume=True`` continues a run."""

    def __init__(self, config: TrainConfig, resume: bool = False, report: Callable[[str], None] = print,
                 batch_hook: Callable[[RolloutBatch], None] | None = None,
                 rollout_source: Callable[["Trainer"], Any] | None = None, overwrite: bool = False):
        """``rollout_source(trainer)`` builds where batches come from (default :class:`LiveRollouts`: play the
        envs now; ``stppo_agent.replay`` passes recorded batches). A folder that holds a run needs ``resume``
        or ``overwrite`` (:mod:`stppo_agent.run_folder`)."""
        config.validate()
        self.device = resolve_device(config.device)
        config = with_resolved_precision(config, self.device)
        self.config, self.report, self.batch_hook = config, report, batch_hook
        self.algo = config.algorithm_config()
        self.run_dir = Path(config.output_dir)
        self.sharded = config.strategy == "fsdp2"
        if self.sharded:
            distributed.ensure_process_group()
        self.rank, self.world = distributed.rank(), distributed.world_size()
        if config.prompts_per_iteration % self.world or config.mini_batch_size % self.world:
            raise ValueError(f"prompts_per_iteration ({config.prompts_per_iteration}) and mini_batch_size "
                             f"({config.mini_batch_size}) must be multiples of the number of processes ({self.world})")
        self.iteration, self.optimizer_steps, self.nan_skips_in_a_row, self.nan_skips_total = 0, 0, 0, 0
        self.actor_lr_scale = 1.0  # the rollbacks' compounded learning-rate factor (saved in checkpoints)
        self._bar = None  # the progress bar while train() runs
        distributed.seed_everything(config.seed)  # the same on every rank: models are built identically
        checkpoint = run_folder.prepare_on_all_ranks(self.run_dir, resume=resume, overwrite=overwrite, report=report)
        trainer_state.check_resume_settings(self, checkpoint)  # a refused change fails before the models load
        self._build_models(checkpoint)
        if self.rank > 0:  # each rank samples its own tokens; rank 0 continues the one-process stream unchanged
            distributed.seed_everything(distributed.rank_seed(config.seed, self.rank))
        self.source = (rollout_source or LiveRollouts)(self)
        if checkpoint is not None:
            trainer_state.resume(self, checkpoint)
        self.logger = None
        if distributed.is_main():  # one process writes the run folder
            self.logger = MetricsLogger(self.run_dir, tensorboard=config.tensorboard,
                                        wandb_project=config.wandb_project, config=dataclasses.asdict(config))
            self.logger.truncate_after(self.iteration, report)
            (self.run_dir / "config.yaml").write_text(config.to_yaml(resolved=self.algo))
        self.recorder = RolloutRecorder.for_trainer(self) if config.save_rollouts else None
        self.diagnostics = StepDiagnostics.for_trainer(self)
        self.guard = CollapseGuard(self) if config.on_collapse != "none" else None

    # -- setup ---------------------------------------------------------------------------------------------
    def _build_models(self, checkpoint: Path | None) -> None:
        config, algo = self.config, self.algo
        need_reference = algo.kl_in_reward > 0 or algo.kl_loss_coef > 0
        # On resume the actor and critic come from the checkpoint; the reference is always the initial policy.
        actor_path = str(checkpoint / "actor") if checkpoint is not None else config.model
        critic_path = str(checkpoint / "critic") if checkpoint is not None else config.critic_model
        models = load_policy_models(actor_path, critic_path=critic_path, use_critic=algo.use_critic,
                                    need_reference=need_reference, dtype=config.dtype,
                                    gradient_checkpointing=config.gradient_checkpointing, reference_path=config.model,
                                    autocast_dtype=config.autocast_dtype)
        self.tokenizer = models.tokenizer
        self.actor = models.actor.to(self.device)
        self.critic = models.critic.to(self.device) if models.critic is not None else None
        self.reference = models.reference.to(self.device) if models.reference is not None else None
        for model in (self.actor, self.critic):
            if model is not None:
                _disable_dropout(model)
                model.train()
        if self.sharded:  # sharded in place: the same modules train, score and (gathered) generate
            compute_dtype = DTYPES[config.fsdp_compute_dtype] if config.fsdp_compute_dtype else None
            for model in (self.actor, self.critic, self.reference):
                if model is not None:
                    distributed.shard_fsdp2(model, compute_dtype)
            self.actor_train, self.critic_train = self.actor, self.critic
        else:  # gradients go through DDP wrappers when distributed; generation and scoring use the plain modules
            self.actor_train = distributed.wrap_ddp(self.actor, self.device)
            self.critic_train = distributed.wrap_ddp(self.critic, self.device) if self.critic is not None else None
        self.actor_optimizer = torch.optim.AdamW(self.actor.parameters(), lr=config.actor_lr,
                                                 weight_decay=config.weight_decay)
        self.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(self.actor_optimizer, _warmup(config.warmup_steps))
        self.critic_optimizer = self.critic_scheduler = None
        if self.critic is not None:
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=config.critic_lr,
                                                      weight_decay=config.weight_decay)
            self.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(self.critic_optimizer,
                                                                      _warmup(config.warmup_steps))
        self.backend = self._generation_backend(checkpoint)

    def _generation_backend(self, checkpoint: Path | None):
        if self.config.generation_backend == "vllm":
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights can be synced
            from .vllm_backend import VLLMGenerationBackend

            path = str(checkpoint / "actor") if checkpoint is not None else self.config.model
            dtype = "bfloat16" if self.config.dtype == "float32" else self.config.dtype
            return VLLMGenerationBackend(path, self.config.sampling(), dtype=dtype,
                                         seed=distributed.rank_seed(self.config.seed, self.rank),
                                         gpu_memory_utilization=self.config.vllm_gpu_memory_utilization)
        return HFGenerationBackend(self.actor, self.tokenizer, self.config.sampling(),
                                   batch_size=self.config.generation_batch_size,
                                   reuse_cache=self.config.reuse_kv_cache)

    # -- one iteration -----------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        bar = tqdm(total=self.config.iterations, initial=self.iteration, desc="training", unit="it",
                   disable=not (self.config.progress and distributed.is_main()))
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
                rollout_seconds = time.perf_counter() - started
                self.phase("scoring")
                self.score(batch)
                metrics = self.update(batch)
                if hasattr(self.backend, "sync_weights"):  # an engine with its own copy of the weights
                    self.backend.sync_weights(self.actor)
                self.iteration += 1
                metrics.update(rollout_statistics(batch, self.algo), rollout_seconds=rollout_seconds,
                               iteration_seconds=time.perf_counter() - started,
                               rollout_tokens_per_s=float(batch.loss_mask.sum()) / max(rollout_seconds, 1e-9))
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

    @torch.no_grad()
    def score(self, batch: RolloutBatch) -> None:
        """Behaviour (pre-update) and reference log-probs, values, then advantages and returns."""
        micro, sampling = self.config.micro_batch_size, self.config.sampling()

        def sampled_logprobs(model, micro_batch):  # under the distribution the rollout sampled from (as verl)
            return token_logprobs(model, micro_batch, sampling=sampling)

        # Under FSDP2 each model is gathered once for all its micro-batches (one all-gather instead of one per
        # micro-batch), and one model at a time, so at most one full copy of weights is held.
        with distributed.gathered(self.actor):
            batch.old_logprobs = batched_no_grad(sampled_logprobs, self.actor, batch, micro)
        if self.reference is not None:
            with distributed.gathered(self.reference):
                batch.ref_logprobs = batched_no_grad(sampled_logprobs, self.reference, batch, micro)
        if self.critic is not None:
            with distributed.gathered(self.critic):
                batch.values = batched_no_grad(critic_values, self.critic, batch, micro)
        kl_penalty = None
        if self.algo.kl_in_reward > 0 and batch.ref_logprobs is not None:
            kl_penalty = kl_reward_penalty(batch.old_logprobs, batch.ref_logprobs, batch.loss_mask, self.algo)
        values = batch.values if batch.values is not None else torch.zeros_like(batch.old_logprobs)
        # Whitening must use the statistics of the whole global batch, so with several ranks it happens here.
        whiten_globally = self.world > 1 and self.algo.whiten_advantages
        estimator_config = dataclasses.replace(self.algo, whiten_advantages=False) if whiten_globally else self.algo
        batch.advantages, batch.returns = get_advantage_estimator(self.algo.advantage)(
            rewards=batch.rewards.to(self.device), values=values, loss_mask=batch.loss_mask,
            group_ids=batch.group_ids, config=estimator_config, kl_penalty=kl_penalty)
        if whiten_globally:
            batch.advantages = distributed.distributed_whiten(batch.advantages, batch.loss_mask)
        mask = batch.loss_mask
        batch.stats["advantage/mean"] = float(batch.advantages[mask].mean()) if mask.any() else 0.0
        batch.stats["advantage/std"] = float(batch.advantages[mask].std()) if mask.sum() > 1 else 0.0
        weights, mismatch = rollout_correction_weights(batch.old_logprobs, batch.sample_logprobs, mask,
                                                       batch.turn_ids, self.algo)
        batch.stats.update(mismatch)
        if weights is not None:  # w' >= 0 times the advantage = w' times each token's clipped surrogate
            batch.advantages = batch.advantages * weights
        if batch.ref_logprobs is not None and mask.any():
            batch.stats["kl_to_reference"] = float((batch.old_logprobs - batch.ref_logprobs)[mask].mean())

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """PPO epochs over this rank's scored share of the batch. The mini-batches are global: with several
        processes every rank gathers the global batch and takes its rows of each global mini-batch
        (:mod:`stppo_agent.global_batch`), so the steps are those of one process on the global batch."""
        config = self.config
        means = StepMeans()
        tokens, started = 0, time.perf_counter()
        generator = torch.Generator().manual_seed(config.seed + self.iteration)
        if self.diagnostics is not None:
            self.diagnostics.begin_iteration(self.iteration + 1)
        if self.world > 1:
            batch = gather_global_batch(batch, self.tokenizer.pad_token_id)
        size = config.mini_batch_size
        total_steps, step = config.ppo_epochs * math.ceil(batch.batch_size / size), 0
        for epoch in range(config.ppo_epochs):
            order = torch.randperm(batch.batch_size, generator=generator)
            for start in range(0, batch.batch_size, size):
                mini = batch.select(mini_batch_rows(order, start, size, self.rank, self.world))
                step += 1
                self.phase(f"update step {step}/{total_steps}")
                step_metrics = self._optimizer_step(mini)
                tokens += int(mini.loss_mask.sum())
                means.add(step_metrics, on_policy=epoch == 0 and start == 0)  # the actor has not moved yet
        metrics = means.means()
        metrics["update_tokens_per_s"] = tokens / max(time.perf_counter() - started, 1e-9)
        metrics["nan_skips_total"] = self.nan_skips_total
        metrics["actor_lr"] = self.actor_scheduler.get_last_lr()[0]
        return metrics

    def _optimizer_step(self, mini: RolloutBatch) -> dict[str, float]:
        """One actor (and critic) optimizer step over ``mini`` with gradient accumulation."""
        metrics = self._actor_step(mini)
        if self.critic is not None:
            metrics.update(self._critic_step(mini))
        return metrics

    def _micro_batches(self, mini: RolloutBatch, ddp_module: torch.nn.Module | None = None):
        """Length-grouped, trimmed micro-batches of ``mini``; under DDP, gradients are all-reduced only after
        the last one."""
        micros = [micro for _, micro in length_sorted_micro_batches(mini, self.config.micro_batch_size)]
        for number, micro in enumerate(micros):
            last = number == len(micros) - 1
            if ddp_module is not None and hasattr(ddp_module, "no_sync") and not last:
                with ddp_module.no_sync():
                    yield micro
            else:
                yield micro

    def _global_counts(self, mini: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy tokens and trajectories of the *global* mini-batch, divided by the number of ranks: DDP
        averages gradients over ranks, so each rank normalises by global / world to get the global mean."""
        counts = torch.stack([mini.loss_mask.sum(), mini.loss_mask.any(1).sum()]).float()
        tokens, seqs = distributed.all_reduce_sum(counts) / self.world
        return tokens.clamp(min=1 / self.world), seqs.clamp(min=1 / self.world)

    def actor_gradients(self, mini: RolloutBatch) -> dict[str, float]:
        """Fill the actor's ``.grad`` for one optimizer step over ``mini`` (clip-bias correction and gradient
        clipping included) and return the step's metrics; ``grad_norm`` is NaN when the step must be skipped."""
        algo, loss_fn = self.algo, get_policy_loss(self.algo.policy_loss)
        params = [p for p in self.actor.parameters() if p.requires_grad]
        # With step diagnostics, ||C|| is measured for every algorithm (only S-PPO / ST-PPO rescale by it).
        corrector = ClipBiasCorrector(params, algo.clip_bias_kappa, through_grad=self.sharded,
                                      rescale=algo.clip_bias_correction) \
            if algo.clip_bias_correction or self.config.step_diagnostics else None
        global_tokens, global_seqs = self._global_counts(mini)
        self.actor_optimizer.zero_grad(set_to_none=True)
        step_metrics = StepMetrics()
        finite = torch.ones((), device=self.device)
        for micro in self._micro_batches(mini, self.actor_train):
            logprobs, entropy = token_logprobs(self.actor_train, micro, with_entropy=True,
                                               entropy_grad=algo.entropy_coef > 0, sampling=self.config.sampling())
            loss, bias, metrics = loss_fn(
                logprobs=logprobs, old_logprobs=micro.old_logprobs, advantages=micro.advantages,
                loss_mask=micro.loss_mask, turn_ids=micro.turn_ids, config=algo,
                ref_logprobs=micro.ref_logprobs if algo.kl_loss_coef > 0 else None, entropy=entropy,
                global_num_tokens=global_tokens, global_num_seqs=global_seqs)
            finite = finite * torch.isfinite(loss)
            if self.diagnostics is not None:
                self.diagnostics.observe_micro(micro, logprobs)
            if corrector is not None:
                corrector.accumulate(bias, anchor=logprobs)
            loss.backward()  # always, even when NaN: every rank must join DDP's all-reduce; NaN then skips
            step_metrics.add(metrics, micro.loss_mask.sum())
        out = step_metrics.reduce()
        if corrector is not None:
            corrector.all_reduce()
            out.update({k: float(v) for k, v in corrector.apply().items()})
        grad_norm = distributed.clip_grad_norm(params, self.config.max_grad_norm)
        ok = bool(distributed.all_reduce_sum(finite) == self.world) and bool(torch.isfinite(grad_norm))
        out["grad_norm"] = float(grad_norm) if ok else math.nan
        return out

    def _actor_step(self, mini: RolloutBatch) -> dict[str, float]:
        out = self.actor_gradients(mini)
        if not math.isfinite(out["grad_norm"]):
            return self._skip_step(out, "actor")
        if self.diagnostics is not None:  # the gradient the optimizer is about to apply
            params = [p for p in self.actor.parameters() if p.requires_grad]
            out.update(self.diagnostics.finish_step(params, out, self.optimizer_steps))
        self.nan_skips_in_a_row = 0
        self.actor_optimizer.step()
        self.actor_scheduler.step()
        self.optimizer_steps += 1
        return out

    def _skip_step(self, metrics: dict[str, float], which: str) -> dict[str, float]:
        self.actor_optimizer.zero_grad(set_to_none=True)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        self.nan_skips_in_a_row += 1
        self.nan_skips_total += 1
        self.report(f"iteration {self.iteration + 1}: non-finite {which} loss or gradient; update skipped "
                    f"({self.nan_skips_in_a_row} in a row)")
        if self.nan_skips_in_a_row > self.config.max_nan_skips:
            raise TrainingDivergedError(
                f"{self.nan_skips_in_a_row} consecutive updates had NaN/inf losses or gradients; stopping. "
                f"The last valid checkpoint is in {self.run_dir / 'checkpoints'}; lower the learning rate, "
                "raise max_grad_norm headroom, or check the data and rewards, then --resume.")
        metrics["skipped"] = 1.0
        return metrics

    def _critic_step(self, mini: RolloutBatch) -> dict[str, float]:
        global_tokens, _ = self._global_counts(mini)
        self.critic_optimizer.zero_grad(set_to_none=True)
        step_metrics = StepMetrics()
        finite = torch.ones((), device=self.device)
        for micro in self._micro_batches(mini, self.critic_train):
            values = critic_values(self.critic_train, micro)
            loss, metrics = value_loss(values=values, old_values=micro.values, returns=micro.returns,
                                       loss_mask=micro.loss_mask, config=self.algo, global_num_tokens=global_tokens)
            finite = finite * torch.isfinite(loss)
            loss.backward()
            step_metrics.add(metrics, micro.loss_mask.sum())
        totals = step_metrics.reduce()
        grad_norm = distributed.clip_grad_norm(list(self.critic.parameters()), self.config.max_grad_norm)
        totals["critic_grad_norm"] = float(grad_norm)
        if not (bool(distributed.all_reduce_sum(finite) == self.world) and math.isfinite(totals["critic_grad_norm"])):
            return self._skip_step(dict(totals), "critic")
        self.critic_optimizer.step()
        self.critic_scheduler.step()
        return dict(totals)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Rank 0 writes one checkpoint of full tensors (gathered from FSDP2 shards)."""
        tensor_state, json_state = trainer_state.checkpoint_states(self)
        actor_state, critic_state = self.full_states()
        path = self.run_dir / "checkpoints" / f"step-{self.iteration}"
        if distributed.is_main():  # the full state dicts above live on rank 0 only (cpu_offload)
            path = save_checkpoint(self.run_dir, self.iteration, actor=self.actor, tokenizer=self.tokenizer,
                                   critic=self.critic, tensor_state=tensor_state, json_state=json_state,
                                   keep=self.config.keep_checkpoints, actor_state=actor_state,
                                   critic_state=critic_state,
                                   protect=self.guard.protected_steps() if self.guard is not None else ())
        distributed.barrier()
        return path

    def full_states(self) -> tuple[dict | None, dict | None]:
        """Full actor and critic state dicts gathered from FSDP2 shards (a collective); None, None unsharded."""
        if not self.sharded:
            return None, None
        return full_model_state(self.actor), full_model_state(self.critic) if self.critic is not None else None


def read_metrics(run_dir: str | Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """A run's JSON-lines records: its metrics.jsonl, or another such file (``name="steps.jsonl"``)."""
    path = Path(run_dir) / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
