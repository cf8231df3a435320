"""The tensors of docs/algorithms.md for a batch of trajectories, and the trajectories they are built from."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import gymnasium as gym
import torch

from stppo_agent.rollouts.episode_stats import episode_rates


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        if sequence:
            input_ids[row, width - len(sequence):] = torch.tensor(sequence, dtype=torch.long)
            attention_mask[row, width - len(sequence):] = 1
    return input_ids.to(device), attention_mask.to(device)


@dataclasses.dataclass
class Trajectory:
    """One episode being built: its env, its prompt ids, and the response pieces with their roles."""

    env: gym.Env
    group_id: int
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    policy_mask: list[bool] = dataclasses.field(default_factory=list)
    turn_ids: list[int] = dataclasses.field(default_factory=list)
    sample_logprobs: list[float] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    terminated: bool = False
    truncated: bool = False
    finish_reason: str = ""
    turns: int = 0
    search_calls: int = 0
    invalid_actions: int = 0
    search_errors: int = 0
    answered: bool = False
    observations: int = 0  # env observations appended to the transcript
    observations_cut: int = 0  # of those, cut to max_observation_tokens (passages the policy never saw)
    info: dict = dataclasses.field(default_factory=dict)  # what reset said of the episode (example_id, ...)

    def counters(self) -> dict[str, int]:
        """The per-episode counters :func:`episode_rates` reads."""
        return {key: getattr(self, key) for key in ("turns", "invalid_actions", "search_calls", "search_errors",
                                                     "answered")}

    def append(self, ids: Sequence[int], *, policy: bool, turn: int, logprobs: Sequence[float] | None = None):
        self.response_ids += list(ids)
        self.policy_mask += [policy] * len(ids)
        self.turn_ids += [turn if policy else -1] * len(ids)
        self.sample_logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


@dataclasses.dataclass
class RolloutBatch:
    """Tensors of docs/algorithms.md for B trajectories. ``input_ids`` = left-padded prompt (width P) followed by the
    right-padded response (width T); per-token tensors cover the response positions."""

    input_ids: torch.Tensor  # (B, P + T) long
    attention_mask: torch.Tensor  # (B, P + T) long
    prompt_width: int
    response_ids: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) bool
    turn_ids: torch.Tensor  # (B, T) long
    sample_logprobs: torch.Tensor  # (B, T) float, behaviour log-probs recorded at sampling time
    rewards: torch.Tensor  # (B,) float
    group_ids: torch.Tensor  # (B,) long
    terminated: torch.Tensor  # (B,) bool
    truncated: torch.Tensor  # (B,) bool
    stats: dict[str, float]
    old_logprobs: torch.Tensor | None = None  # (B, T) under the actor before the update (recomputed)
    ref_logprobs: torch.Tensor | None = None  # (B, T) under the frozen reference
    values: torch.Tensor | None = None  # (B, T) critic values before the update
    advantages: torch.Tensor | None = None  # (B, T)
    returns: torch.Tensor | None = None  # (B, T)
    token_weights: torch.Tensor | None = None  # (B, T) weight of each token's policy-loss term; 0 drops the token
    episode_info: list[dict] | None = None  # per trajectory: example_id, benchmark, question, finish_reason

    @property
    def batch_size(self) -> int:
        return int(self.response_ids.shape[0])

    def select(self, rows: Sequence[int] | torch.Tensor) -> "RolloutBatch":
        """The sub-batch of ``rows`` (tensors indexed, stats kept)."""
        index = torch.as_tensor(rows, dtype=torch.long)
        fields = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                value = value[index.to(value.device)]
            elif isinstance(value, list):
                value = [value[i] for i in index.tolist()]
            fields[field.name] = value
        return RolloutBatch(**fields)

    def trimmed(self) -> "RolloutBatch":
        """The same trajectories without the padding columns none of them uses: prompt columns left of the
        longest prompt and response columns right of the longest response. A micro-batch of short trajectories
        then does not pay for the longest one of the whole batch. Per-token tensors are cut to the new width."""
        width = self.response_ids.shape[1]
        used = self.attention_mask[:, :self.prompt_width].bool().any(0)
        left = int(used.long().argmax()) if bool(used.any()) else self.prompt_width - 1
        left = min(left, self.prompt_width - 1)  # keep the column that predicts the first response token
        right = max(1, int(self.attention_mask[:, self.prompt_width:].sum(1).max()))
        if left == 0 and right == width:
            return self
        fields = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                value = value[:, left:self.prompt_width + right] if field.name in ("input_ids", "attention_mask") \
                    else value[:, :right]
            fields[field.name] = value
        fields["prompt_width"] = self.prompt_width - left
        return RolloutBatch(**fields)

    def lengths(self) -> torch.Tensor:
        """Tokens of each trajectory, prompt and response (B,)."""
        return self.attention_mask.sum(1)

    def to(self, device) -> "RolloutBatch":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})


def to_batch(trajectories: Sequence[Trajectory], pad_id: int) -> RolloutBatch:
    """The trajectories as one padded batch, built on the host whatever torch's default device (a GPU user's
    may be CUDA): the trainer moves it with ``.to`` once."""
    with torch.device("cpu"):
        return _assemble(trajectories, pad_id)


def _assemble(trajectories: Sequence[Trajectory], pad_id: int) -> RolloutBatch:
    batch = len(trajectories)
    prompt_width = max(len(t.prompt_ids) for t in trajectories)
    response_width = max(1, max(len(t.response_ids) for t in trajectories))
    prompt_ids, prompt_mask = left_pad([t.prompt_ids for t in trajectories], pad_id, "cpu")
    response_ids = torch.full((batch, response_width), pad_id, dtype=torch.long)
    response_attention = torch.zeros((batch, response_width), dtype=torch.long)
    loss_mask = torch.zeros((batch, response_width), dtype=torch.bool)
    turn_ids = torch.full((batch, response_width), -1, dtype=torch.long)
    sample_logprobs = torch.zeros((batch, response_width), dtype=torch.float32)
    for row, t in enumerate(trajectories):
        n = len(t.response_ids)
        if n:
            response_ids[row, :n] = torch.tensor(t.response_ids)
            response_attention[row, :n] = 1
            loss_mask[row, :n] = torch.tensor(t.policy_mask)
            turn_ids[row, :n] = torch.tensor(t.turn_ids)
            sample_logprobs[row, :n] = torch.tensor(t.sample_logprobs)
    stats = {
        "reward": sum(t.reward for t in trajectories) / batch,
        "response_tokens": float(loss_mask.sum()) / batch,
        "turns": sum(t.turns for t in trajectories) / batch,
        "search_calls": sum(t.search_calls for t in trajectories) / batch,
        "search_errors": sum(t.search_errors for t in trajectories) / batch,  # with search_calls: the attempts
        **episode_rates([t.counters() for t in trajectories]),
        "truncated_max_total_tokens": sum(t.finish_reason == "max_total_tokens" for t in trajectories) / batch,
        "observations": sum(t.observations for t in trajectories) / batch,
        "observation_cut_rate": sum(t.observations_cut for t in trajectories) / max(1, sum(t.observations
                                                                                         for t in trajectories)),
    }
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, response_attention], dim=1),
        prompt_width=prompt_width, response_ids=response_ids, loss_mask=loss_mask, turn_ids=turn_ids,
        sample_logprobs=sample_logprobs, rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        terminated=torch.tensor([t.terminated for t in trajectories]),
        truncated=torch.tensor([t.truncated for t in trajectories]), stats=stats,
        episode_info=[{**t.info, "finish_reason": t.finish_reason} for t in trajectories],
    )
