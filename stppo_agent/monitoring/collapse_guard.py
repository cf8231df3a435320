"""What a run does when :mod:`stppo_agent.monitoring.collapse_rules` raises an alarm (``monitor.on_collapse``): the
guard decides, every iteration, and returns a :class:`Decision` that the training loop carries out.

- ``warn``: a clear line (which signals, their values, their recent range) and the event in ``metrics.jsonl``;
- ``stop``: also checkpoints and stops (:class:`CollapseStopped`) with advice;
- ``rollback``: restores the newest *healthy* checkpoint taken before the collapse began, scales the actor's
  learning rate by ``monitor.rollback_lr_factor`` and continues, at most ``monitor.max_rollbacks`` times (then it
  stops). The factor compounds (x0.5 twice is x0.25, whichever checkpoint each rollback returns to) and survives
  ``--resume``; ``collapse/lr_scale`` and ``collapse/actor_lr`` log the scale and the rate from then on.
  Iterations keep counting (they are rollouts spent); the checkpoints written during the collapse are moved
  aside to ``checkpoints/.collapsed-step-N`` (kept for inspection, never resumed from), and the restored state
  is saved at once as the current iteration's checkpoint, so ``--resume`` continues the rolled-back run.

A checkpoint is *healthy* when the iteration that made it and the one whose rollouts its weights sampled (the next,
or K + 1 later under ``rollout.staleness`` K) tripped no signal
(:func:`stppo_agent.runs.checkpoint_health.healthy_steps`). A rollback returns only to a healthy checkpoint that
holds optimizer state (one written under ``checkpoint.optimizer=newest`` before a resume may not): with none, the
run stops as ``stop`` does. Pruning keeps the newest healthy checkpoint and the best one (by
:func:`stppo_agent.runs.checkpoint_health.checkpoint_reward`) besides the ``checkpoint.keep`` newest.

The first process decides (it holds the run's metrics); every process gets its decision and carries it out.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from stppo_agent.distributed import process_group
from stppo_agent.monitoring.collapse_rules import CollapseMonitor, MonitorSettings, Verdict
from stppo_agent.runs.checkpoint import holds_resume_state, list_checkpoints, set_aside, valid_checkpoints
from stppo_agent.runs.checkpoint_health import STALENESS_KEY, best_step, healthy_steps


class CollapseStopped(RuntimeError):
    """The collapse monitor stopped the run (``monitor.on_collapse=stop``, or rollbacks exhausted)."""


ACTIONS = ("continue", "warn", "stop", "rollback")


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the run does after an iteration: ``continue`` (no alarm), ``warn`` (say ``reason`` and continue),
    ``stop`` (checkpoint, then stop) or ``rollback`` (to checkpoint ``step-{rollback_to}``, then continue)."""

    action: str = "continue"
    reason: str = ""
    rollback_to: int | None = None

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"a decision is one of {', '.join(ACTIONS)}, not {self.action!r}")
        if (self.action == "rollback") != (self.rollback_to is not None):
            raise ValueError("a rollback, and only a rollback, names the checkpoint step it returns to")

    @property
    def alarmed(self) -> bool:
        """Anything but ``continue``: the run reports the reason and checkpoints at once."""
        return self.action != "continue"

    @property
    def stops(self) -> bool:
        return self.action == "stop"

    @property
    def rolls_back(self) -> bool:
        return self.action == "rollback"


CONTINUE = Decision()


_KEPT_KEYS = ("step", "reward", STALENESS_KEY, "collapse/tripped", "collapse/alarm", "collapse/warmup")


class CollapseGuard:
    """Watches a run's iterations (``config``: its TrainConfig; ``run_dir``: its folder, whose metrics and
    checkpoints it reads) and decides what the run does."""

    def __init__(self, config, run_dir: Path):
        self.config, self.run_dir = config, run_dir
        self.monitor = CollapseMonitor(MonitorSettings.from_config(self.config))
        self.records: list[dict[str, Any]] = []  # what checkpoint health needs, per logged iteration
        self.rollbacks = 0
        if process_group.is_main():
            from stppo_agent.runs.metrics_log import read_metrics

            past = read_metrics(run_dir)  # already cut back to the resumed checkpoint
            self.monitor.reobserve(past)
            self.records = [_kept(r) for r in past]
            self.rollbacks = sum("collapse/rollback_to" in r for r in past)

    # -- every iteration -----------------------------------------------------------------------------------
    def check(self, iteration: int, metrics: dict[str, Any], actor_lr_scale: float = 1.0) -> Decision:
        """Score iteration ``iteration`` (its ``metrics`` gain the ``collapse/...`` keys, ``collapse/action`` when
        the decision is not to continue) and decide; ``actor_lr_scale``: the run's rollback factor so far (a
        rollback's reason states the rate it leads to). Changes nothing else: the caller carries the decision out
        (a rollback, then :meth:`rolled_back`)."""
        decision = CONTINUE
        if process_group.is_main():
            verdict = self.monitor.observe(iteration, metrics)
            metrics.update(verdict.metrics())
            self.records.append(_kept({**metrics, "step": iteration}))
            if verdict.alarm:
                decision = self._decide(verdict, actor_lr_scale)
        if process_group.world_size() > 1:
            decision = process_group.all_gather_objects(decision)[0]
        if decision.alarmed:
            metrics["collapse/action"] = decision.action
        return decision

    def _decide(self, verdict: Verdict, actor_lr_scale: float) -> Decision:
        config = self.config
        head = f"collapse alarm at iteration {verdict.iteration} (signals since iteration {verdict.onset}): " \
               f"{verdict.describe()}"
        healthy = healthy_steps(self.records, valid_checkpoints(self.run_dir))
        known = f"the newest healthy checkpoint is step-{healthy[-1]}" if healthy else "no checkpoint is known healthy"
        if config.monitor.on_collapse == "warn":
            return Decision("warn", f"{head}. Training continues (monitor.on_collapse=warn); {known}. If the reward "
                                    f"falls, lower optimizer.actor_lr or use --set monitor.on_collapse=rollback.")
        if config.monitor.on_collapse == "rollback":
            if self.rollbacks >= config.monitor.max_rollbacks:
                return Decision("stop", f"{head}. Already rolled back {self.rollbacks} time(s) (monitor.max_rollbacks="
                                        f"{config.monitor.max_rollbacks}): stopping; {known}. The collapse is not only "
                                        "the learning rate: check the rewards and the data, or lower "
                                        "optimizer.actor_lr and clip_high further.")
            if not healthy:
                return Decision("stop", f"{head}. Cannot roll back: {known} (checkpoints every checkpoint.every="
                                        f"{config.checkpoint.every} iterations; a healthy one needs two quiet "
                                        "iterations). Stopping; lower optimizer.actor_lr, or save more often.")
            folders = self.run_dir / "checkpoints"
            resumable = [s for s in healthy if holds_resume_state(folders / f"step-{s}")]
            if not resumable:
                return Decision("stop", f"{head}. Cannot roll back: {known}, and no healthy checkpoint holds "
                                        "optimizer state (written under checkpoint.optimizer=newest, which keeps it "
                                        f"in the newest only). Stopping; its weights start a new run: --model "
                                        f"{folders / f'step-{healthy[-1]}' / 'actor'}, or continue with --resume "
                                        "--set optimizer.actor_lr=<lower>.")
            factor = config.monitor.rollback_lr_factor
            rate = config.optimizer.actor_lr * actor_lr_scale * factor  # compounded over earlier rollbacks
            return Decision("rollback", f"{head}. Rolling back to step-{resumable[-1]} with the actor learning "
                                        f"rate x{factor}, now {rate:.4g} (rollback {self.rollbacks + 1} of at most "
                                        f"{config.monitor.max_rollbacks}).", rollback_to=resumable[-1])
        return Decision("stop", f"{head}. Stopping (monitor.on_collapse=stop); {known}. Continue with --resume "
                                f"--set optimizer.actor_lr=<lower>, or use --set monitor.on_collapse=rollback.")

    # -- after a rollback --------------------------------------------------------------------------------
    def rolled_back(self, step: int) -> None:
        """The run went back to ``step-{step}``: the checkpoints written since are moved aside, the monitor forgets
        the iterations after it, and the rollback counts toward ``monitor.max_rollbacks``."""
        if process_group.is_main():
            for later in (s for s in list_checkpoints(self.run_dir) if s > step):
                set_aside(self.run_dir / "checkpoints" / f"step-{later}", "collapsed")
            self.monitor.forget_after(step)
        process_group.barrier()
        self.rollbacks += 1

    # -- checkpoints -------------------------------------------------------------------------------------
    def protected_steps(self) -> set[int]:
        """Checkpoints pruning must keep: the newest healthy one and the best one."""
        steps = list_checkpoints(self.run_dir)
        healthy = healthy_steps(self.records, steps)
        best = best_step(self.records, steps)
        return {s for s in (healthy[-1] if healthy else None, best) if s is not None}


def stop_advice(decision: Decision, checkpoint: Path) -> str:
    return f"{decision.reason} The state at the alarm is saved in {checkpoint}."


def _kept(record: dict[str, Any]) -> dict[str, Any]:
    return {key: record[key] for key in _KEPT_KEYS if key in record}
