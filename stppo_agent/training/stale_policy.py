"""Rollouts from a lagged policy (``rollout_staleness: K``): iteration i samples with the weights the actor had
K iterations earlier (after ``max(0, i - K)`` updates) -- the data an asynchronous trainer, whose generation runs
while the learner updates, feeds its learner. The lag is deterministic and part of every checkpoint, so a resumed
run continues it exactly.

Two ways to learn from such data (``stale_objective``):

- ``coupled`` (what a synchronous PPO loop does when handed stale data): the PPO ratio's denominator is the
  behaviour policy, pi_theta / pi_{theta_{i-K}}, so the ratio carries the whole lag and the clip acts on it.
- ``decoupled`` (AReaL's decoupled PPO, Fu et al. 2025): the ratio's denominator is the *proximal* policy -- the
  current weights before the update -- and the lag enters as a separate importance weight pi_prox / pi_behav per
  token for every rule (``auto`` resolves to mis at token level), capped (``rollout_correction`` mis drops tokens
  above ``rollout_correction_cap``, tis truncates them) and never differentiated;
  :mod:`stppo_agent.algorithms.rollout_correction` computes it from the behaviour log-probs recorded at sampling
  time. M2PO's second moment is taken on the same pair (proximal against behaviour), as AReaL does.

Under both objectives ``kl_to_reference`` and the reward's KL penalty are the behaviour policy's (the weights that
sampled the tokens), so the columns of a coupled and a decoupled run mean the same; ``learner_kl_to_reference`` is
the policy being updated.

K = 0 changes nothing: the generating model is the actor itself and no copy is made.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from stppo_agent.models.precision import independent_copy

OBJECTIVES = ("coupled", "decoupled")


def is_decoupled(config) -> bool:
    """The decoupled objective is in effect: ``stale_objective=decoupled`` with a lag to decouple (K > 0)."""
    return config.rollout_staleness > 0 and config.stale_objective == "decoupled"


class StalePolicy:
    """The generating (behaviour) model of a run with ``staleness`` K, and the weights it will take next.

    ``model`` holds the weights after ``max(0, i - K)`` updates while iteration i plays; ``pending`` holds the later
    ones in order (at most K). :meth:`advance` is called after each update with the actor's new weights.
    """

    def __init__(self, actor: torch.nn.Module, staleness: int, autocast_dtype: str | None = None):
        if staleness < 0:
            raise ValueError(f"rollout_staleness must be >= 0, got {staleness}")
        self.staleness = staleness
        self.model = actor if staleness == 0 else independent_copy(actor, autocast_dtype)
        if staleness:
            self.model.eval()
            self.model.requires_grad_(False)
        self.pending: deque[dict[str, torch.Tensor]] = deque()

    @property
    def lag(self) -> int:
        """Updates between the generating weights and the actor's now: min(K, iterations done)."""
        return len(self.pending)

    @torch.no_grad()
    def advance(self, actor: torch.nn.Module) -> None:
        """The actor has just been updated: queue its weights; the generator moves one step once K are queued."""
        if self.staleness == 0:
            return
        self.pending.append({name: value.detach().clone() for name, value in actor.state_dict().items()})
        if len(self.pending) > self.staleness:
            self.model.load_state_dict(self.pending.popleft())

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the generating weights and the queue (nothing when K = 0)."""
        if self.staleness == 0:
            return {}
        weights = {name: value.detach().clone() for name, value in self.model.state_dict().items()}
        return {"model": weights, "pending": [dict(state) for state in self.pending]}

    @torch.no_grad()
    def load(self, state: dict[str, Any] | None) -> None:
        if self.staleness == 0:
            return
        if not state:
            raise ValueError(f"the checkpoint holds no lagged policy, but rollout_staleness is {self.staleness}: it "
                             "was written by a run without staleness, which cannot be continued with it")
        self.model.load_state_dict(state["model"])
        self.pending = deque(state["pending"])
