"""Rollouts from a lagged policy (``rollout.staleness: K``): iteration i samples with the weights the actor had
K iterations earlier (after ``max(0, i - K)`` updates) -- the data an asynchronous trainer, whose generation runs
while the learner updates, feeds its learner. The lag is deterministic and part of every checkpoint, so a resumed
run continues it exactly.

Two ways to learn from such data (``rollout.stale_objective``):

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
    """The decoupled objective is in effect: ``rollout.stale_objective=decoupled`` with a lag to decouple (K > 0)."""
    return config.rollout.staleness > 0 and config.rollout.stale_objective == "decoupled"


class StalePolicy:
    """The generating (behaviour) model of a run with ``staleness`` K, and the weights it will take next.

    ``model`` holds the weights after ``max(0, i - K)`` updates while iteration i plays; ``pending`` holds the later
    ones in order (at most K). :meth:`advance` is called after each update with the actor's new weights.
    """

    def __init__(self, actor: torch.nn.Module, staleness: int, autocast_dtype: str | None = None):
        if staleness < 0:
            raise ValueError(f"rollout.staleness must be >= 0, got {staleness}")
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
        self.pending.append(_copy(actor.state_dict()))
        if len(self.pending) > self.staleness:
            self.model.load_state_dict(self.pending.popleft())

    @torch.no_grad()
    def state(self, actor: torch.nn.Module) -> dict[str, Any]:
        """What a checkpoint keeps (nothing when K = 0): the generating weights and the queue, less its newest entry
        when that is ``actor``'s weights (it always is right after :meth:`advance`: the checkpoint's own actor then
        restores it), and which tensor names alias another (tied weights, stored once).
        :mod:`stppo_agent.runs.lagged_weights` writes it."""
        if self.staleness == 0:
            return {}
        pending = list(self.pending)
        from_actor = bool(pending) and _equal(pending[-1], actor.state_dict())
        return {"model": _copy(self.model.state_dict()), "pending": pending[:-1] if from_actor else pending,
                "pending_from_actor": from_actor, "aliases": _aliases(self.model.state_dict())}

    @torch.no_grad()
    def load(self, state: dict[str, Any] | None, actor: torch.nn.Module) -> None:
        """Put back :meth:`state` (``actor``: the checkpoint's actor, already loaded)."""
        if self.staleness == 0:
            return
        if not state:
            raise ValueError(f"the checkpoint holds no lagged policy, but rollout.staleness is {self.staleness}: it "
                             "was written by a run without staleness, which cannot be continued with it")
        self.model.load_state_dict(state["model"])
        pending = [dict(entry) for entry in state["pending"]]
        if state.get("pending_from_actor"):
            pending.append(_copy(actor.state_dict()))
        self.pending = deque(pending)


def _storage(tensor: torch.Tensor) -> tuple:
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached copy of a state dict in which tensors that shared storage (tied weights) still do."""
    copies: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, value in state.items():
        key = _storage(value)
        if key not in copies:
            copies[key] = value.detach().clone()
        out[name] = copies[key]
    return out


def _aliases(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> the first name holding the same storage (a tied output head -> the embedding)."""
    first: dict[tuple, str] = {}
    aliases = {}
    for name, value in state.items():
        key = _storage(value)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
