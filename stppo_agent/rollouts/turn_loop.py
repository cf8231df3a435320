"""Multi-turn rollouts, token-in / token-out, into one :class:`RolloutBatch` of docs/algorithms.md tensors.

Per turn: the policy generates from each active trajectory's exact token sequence until ``</search>``,
``</answer>``, EOS or the per-turn budget; the generated ids are kept as sampled (never decoded and
re-encoded); the action text goes to the env; the env's observation text is tokenised *alone* and appended with
``loss_mask`` False and ``turn_ids`` -1. Policy tokens of the k-th ``env.step`` get ``turn_ids`` k.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import gymnasium as gym

from stppo_agent.algorithms.registry import accepts_keyword
from stppo_agent.rollouts.batch import RolloutBatch, Trajectory, to_batch
from stppo_agent.rollouts.generation import GenerationBackend
from stppo_envs import step_envs

EPISODE_INFO_KEYS = ("example_id", "benchmark", "question")  # what a batch keeps of each env's reset info


class RolloutLimitError(ValueError):
    """A rollout limit is inconsistent or a prompt does not fit; the message names the limit."""


@dataclasses.dataclass(frozen=True)
class RolloutLimits:
    """Every length limit of a rollout, in one place."""

    max_turns: int = 4
    """env steps per trajectory (the env truncates after this many)."""
    max_new_tokens_per_turn: int = 256
    """tokens the policy may generate in one turn."""
    max_observation_tokens: int = 512
    """tokens of one observation kept (the rest is cut, as Search-R1 does)."""
    max_prompt_tokens: int = 1024
    """tokens of the prompt; a longer prompt is an error naming this limit."""
    max_total_tokens: int = 4096
    """prompt + response; a trajectory that reaches it ends (finish_reason max_total_tokens)."""

    def validate(self) -> None:
        for name in ("max_turns", "max_new_tokens_per_turn", "max_observation_tokens", "max_prompt_tokens",
                     "max_total_tokens"):
            if getattr(self, name) < 1:
                raise RolloutLimitError(f"rollout limit {name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens + self.max_new_tokens_per_turn > self.max_total_tokens:
            raise RolloutLimitError(
                f"max_total_tokens ({self.max_total_tokens}) must fit max_prompt_tokens ({self.max_prompt_tokens}) "
                f"+ max_new_tokens_per_turn ({self.max_new_tokens_per_turn})")


def encode_prompt(tokenizer, prompt: str, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The chat template (user turn + generation prompt) when the tokenizer has one, else plain encoding.
    ``template_kwargs``: the template's own options (e.g. Qwen3's ``enable_thinking``)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, **dict(template_kwargs or {}))
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def encode_observation(tokenizer, text: str, max_tokens: int) -> list[int]:
    """An env observation tokenised alone (no special tokens), cut to ``max_tokens`` as Search-R1 does."""
    return tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]


def cut_observation(tokenizer, text: str, max_tokens: int) -> tuple[list[int], bool]:
    """:func:`encode_observation`, and whether it cut anything (passages the policy never saw): one token past the
    budget tells a cut observation from one that fits exactly."""
    ids = encode_observation(tokenizer, text, max_tokens + 1)
    return ids[:max_tokens], len(ids) > max_tokens


def collect_rollouts(backend: GenerationBackend, tokenizer, envs: Sequence[gym.Env],
                     reset_options: Sequence[dict], group_ids: Sequence[int], limits: RolloutLimits,
                     seeds: Sequence[int | None] | None = None,
                     on_turn: Callable[[int, int], None] | None = None) -> RolloutBatch:
    """Run one episode in each env (all in lock-step, one generation call per turn) and batch the result."""
    limits.validate()
    trajectories = []
    for i, env in enumerate(envs):
        prompt, info = env.reset(seed=seeds[i] if seeds else None, options=reset_options[i])
        prompt_ids = encode_prompt(tokenizer, prompt)
        if len(prompt_ids) > limits.max_prompt_tokens:
            raise RolloutLimitError(f"a prompt has {len(prompt_ids)} tokens, over max_prompt_tokens="
                                    f"{limits.max_prompt_tokens} (raise it or shorten the template)")
        episode = {key: info[key] for key in EPISODE_INFO_KEYS if key in info}
        trajectories.append(Trajectory(env, int(group_ids[i]), prompt_ids, info=episode))
    try:
        for turn in range(limits.max_turns):
            active = [t for t in trajectories if not t.done]
            if not active:
                break
            _run_turn(backend, tokenizer, active, turn, limits)
            if on_turn is not None:
                on_turn(turn, len(active))
    finally:
        if hasattr(backend, "end_rollout"):  # per-rollout state (KV caches) is freed
            backend.end_rollout()
    for trajectory in trajectories:
        if not trajectory.done:  # the env allows more turns than the trainer's max_turns
            trajectory.done, trajectory.truncated, trajectory.finish_reason = True, True, "max_turns"
    return to_batch(trajectories, tokenizer.pad_token_id)


def _run_turn(backend, tokenizer, active: list[Trajectory], turn: int, limits: RolloutLimits) -> None:
    budgets = [min(limits.max_new_tokens_per_turn,
                   limits.max_total_tokens - len(t.prompt_ids) - len(t.response_ids)) for t in active]
    contexts = [t.prompt_ids + t.response_ids for t in active]
    # trajectory identities let a backend keep per-trajectory state over turns (KV caches); older backends with
    # generate(contexts, max_new_tokens) still work
    if accepts_keyword(backend.generate, "keys"):
        generations = backend.generate(contexts, max(budgets), keys=[id(t) for t in active])
    else:
        generations = backend.generate(contexts, max(budgets))
    actions = []
    for trajectory, generation, budget in zip(active, generations, budgets):
        ids, logprobs = generation.token_ids[:budget], generation.logprobs[:budget]
        trajectory.append(ids, policy=True, turn=turn, logprobs=logprobs)
        actions.append(tokenizer.decode(ids, skip_special_tokens=True))
    results = step_envs([t.env for t in active], actions)
    for trajectory, (observation, reward, terminated, truncated, info) in zip(active, results):
        trajectory.turns += 1
        trajectory.search_calls = info.get("search_calls", 0)
        trajectory.invalid_actions = info.get("invalid_actions", 0)
        trajectory.search_errors = info.get("search_errors", 0)
        if terminated or truncated:
            trajectory.done, trajectory.reward = True, float(reward)
            trajectory.terminated, trajectory.truncated = bool(terminated), bool(truncated)
            trajectory.answered = info.get("prediction") is not None
            trajectory.finish_reason = "answer" if terminated else "max_turns"
            continue
        obs_ids, cut = cut_observation(tokenizer, observation, limits.max_observation_tokens)
        trajectory.observations += 1
        trajectory.observations_cut += cut
        room = limits.max_total_tokens - len(trajectory.prompt_ids) - len(trajectory.response_ids)
        if len(obs_ids) >= room:  # no space left to generate after this observation
            trajectory.append(obs_ids[:room], policy=False, turn=turn)
            trajectory.done, trajectory.truncated, trajectory.finish_reason = True, True, "max_total_tokens"
            continue
        trajectory.append(obs_ids, policy=False, turn=turn)
