"""Multi-turn rollouts, token-in / token-out, into one :class:`RolloutBatch` of docs/algorithms.md tensors.

Per turn: the policy generates from each active trajectory's exact token sequence until ``</search>``,
``</answer>``, EOS or the per-turn budget; the generated ids are kept as sampled (never decoded and
re-encoded); the action text goes to the env; the env's observation text is tokenised *alone* and appended with
``loss_mask`` False and ``turn_ids`` -1. Policy tokens of the k-th ``env.step`` get ``turn_ids`` k.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Callable, Hashable, Protocol, Sequence

import gymnasium as gym
import torch
import transformers
from transformers import StoppingCriteria, StoppingCriteriaList

from stppo_envs import step_envs

from .append_cache import new_cache
from .episode_stats import episode_rates
from .sampling import (  # SamplingSettings lives with the scoring that follows it; callers import it from here too
    SamplingSettings,
    generation_config,
    project_generation,
    warn_ignored_checkpoint_settings,
)
from .turn_cache import TurnCaches, after_generate, extend_inputs

# transformers 5 renamed generate's past_key_values argument (and output field) to cache
CACHE_ARGUMENT = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"
CACHE_OUTPUT = CACHE_ARGUMENT

STOP_STRINGS = ("</search>", "</answer>")
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


@dataclasses.dataclass
class Generation:
    """One turn's sample: token ids exactly as sampled and their log-probs under the sampling distribution."""

    token_ids: list[int]
    logprobs: list[float]


class GenerationBackend(Protocol):
    """Generates one turn for a batch of token sequences (HF here; vLLM in the scale issue)."""

    def generate(self, contexts: Sequence[Sequence[int]], max_new_tokens: int,
                 keys: Sequence[Hashable] | None = None) -> list[Generation]: ...


class HFGenerationBackend:
    """``model.generate`` with stop strings; behaviour log-probs from the processed scores at sampling time.

    ``generate`` runs with a complete generation config built from ``sampling`` alone
    (:func:`stppo_agent.sampling.generation_config`): a checkpoint's own processors (a repetition penalty,
    ``no_repeat_ngram_size``, ...) are not applied -- the trainer's scoring would not know them -- and a warning
    names them once.

    Given ``keys`` (one per trajectory, stable over a rollout's turns), trajectories are generated in fixed chunks of
    ``batch_size`` and, with ``reuse_cache``, each chunk continues from the key/value cache of its previous turn
    instead of re-encoding the transcript (:mod:`stppo_agent.turn_cache`); :meth:`end_rollout` frees the caches.
    Caches append in place (:mod:`stppo_agent.append_cache`): transformers' default copies the whole cache at every
    token, which long multi-turn contexts pay quadratically.
    """

    def __init__(self, model, tokenizer, sampling: SamplingSettings = SamplingSettings(),
                 stop_strings: Sequence[str] = STOP_STRINGS, batch_size: int = 64, reuse_cache: bool = True):
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.stop_strings, self.batch_size, self.reuse_cache = tuple(stop_strings), batch_size, reuse_cache
        self.eos_ids = _eos_ids(model, tokenizer)
        self.turns = TurnCaches(batch_size)
        warn_ignored_checkpoint_settings(model)

    @torch.no_grad()
    def generate(self, contexts: Sequence[Sequence[int]], max_new_tokens: int,
                 keys: Sequence[Hashable] | None = None) -> list[Generation]:
        if keys is None:  # no trajectory identity: independent chunks, nothing kept
            out: list[Generation] = []
            for start in range(0, len(contexts), self.batch_size):
                part = contexts[start:start + self.batch_size]
                out += self._generate(list(range(len(part))), part, max_new_tokens, None)[0]
            return out
        results: list[Generation | None] = [None] * len(contexts)
        groups = self.turns.groups(keys)
        # a chunk none of whose trajectories plays this turn is done (trajectories do not come back; one that did
        # would be re-encoded): free its cache now rather than at the end of the rollout
        for finished in set(self.turns.states) - {chunk for chunk, _ in groups}:
            del self.turns.states[finished]
        for chunk, positions in groups:
            chunk_keys, chunk_contexts = [keys[p] for p in positions], [contexts[p] for p in positions]
            state = self.turns.states.pop(chunk, None) if self.reuse_cache else None
            generations, state = self._generate(chunk_keys, chunk_contexts, max_new_tokens, state)
            if self.reuse_cache:
                self.turns.states[chunk] = state
            for position, generation in zip(positions, generations):
                results[position] = generation
        return results

    def end_rollout(self) -> None:
        self.turns.clear()

    def _generate(self, keys, contexts, max_new_tokens: int, state):
        """Generate one chunk, continuing ``state``'s cache when the contexts extend it; returns the generations
        and the chunk's new state."""
        device = next(self.model.parameters()).device
        new = state.continuation(keys, contexts) if state is not None else None
        if new is not None:
            state.select(keys)
            input_ids, attention_mask = extend_inputs(state, new, self.tokenizer.pad_token_id)
            cache = state.cache
        else:
            input_ids, attention_mask = left_pad(contexts, self.tokenizer.pad_token_id, device)
            cache = new_cache(self.model.config)
        was_training = self.model.training
        self.model.eval()
        config = generation_config(self.sampling, max_new_tokens=max_new_tokens,
                                   pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.eos_ids)
        # ranks generate independently (an FSDP2 actor is gathered first): never lock-step
        kwargs = dict(generation_config=config, synced_gpus=False)
        if cache is not None:
            kwargs[CACHE_ARGUMENT] = cache
        if self.stop_strings:
            candidates = stop_candidate_ids(self.tokenizer, self.stop_strings)
            kwargs["stopping_criteria"] = StoppingCriteriaList(
                [StopOnStrings(self.tokenizer, self.stop_strings, input_ids.shape[1], candidates)])
        with project_generation(self.model, config):
            output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        self.model.train(was_training)
        generated = output.sequences[:, input_ids.shape[1]:]
        # log p(chosen) = score[chosen] - logsumexp(score) per step, scores after temperature / top-k / top-p: no
        # (B, steps, V) stack nor a V-wide log-softmax output (150 MB per turn for 16 rows of 48 tokens, 49k vocab)
        chosen = torch.stack([score.float().gather(1, generated[:, step:step + 1]).squeeze(1)
                              - torch.logsumexp(score.float(), dim=-1)
                              for step, score in enumerate(output.scores)], dim=1)
        results, lengths = [], []
        for row in range(generated.shape[0]):
            ids = generated[row].tolist()
            length = generated_length(ids, self.tokenizer, self.stop_strings, self.eos_ids)
            lengths.append(length)
            results.append(Generation(ids[:length], chosen[row, :length].tolist()))
        next_state = None
        if self.reuse_cache and output.get(CACHE_OUTPUT) is not None:
            next_state = after_generate(keys, contexts, input_ids, attention_mask, output.sequences, lengths,
                                        output.get(CACHE_OUTPUT))
        return results, next_state


_STOP_CANDIDATES: "weakref.WeakKeyDictionary[object, dict[tuple[str, ...], torch.Tensor]]" = weakref.WeakKeyDictionary()


def stop_candidate_ids(tokenizer, stop_strings: Sequence[str]) -> torch.Tensor:
    """The token ids that, decoded alone, hold the last character of a stop string: only such a token can complete
    one. Decoding the vocabulary once per tokenizer (0.5 s for SmolLM2's 49k tokens) spares every generation step a
    decode of every row's newest token."""
    known = _STOP_CANDIDATES.setdefault(tokenizer, {})
    key = tuple(stop_strings)
    if key not in known:
        last_chars = {stop[-1] for stop in stop_strings}
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
        known[key] = torch.tensor([i for i, text in enumerate(texts) if any(ch in text for ch in last_chars)],
                                  dtype=torch.long)
    return known[key]


class StopOnStrings(StoppingCriteria):
    """Ends a row once the text it generated contains a stop string. Decodes only the last few tokens of rows whose
    newest token is in ``candidate_ids`` (:func:`stop_candidate_ids`), so it works with any tokenizer
    (transformers' own ``stop_strings`` needs a BPE-style vocabulary)."""

    def __init__(self, tokenizer, stop_strings: Sequence[str], prompt_width: int, candidate_ids: torch.Tensor,
                 window: int = 24):
        self.tokenizer, self.stop_strings = tokenizer, tuple(stop_strings)
        self.prompt_width, self.window, self.candidate_ids = prompt_width, window, candidate_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if input_ids.shape[1] <= self.prompt_width:
            return done
        if self.candidate_ids.device != input_ids.device:
            self.candidate_ids = self.candidate_ids.to(input_ids.device)
        candidates = torch.isin(input_ids[:, -1], self.candidate_ids).nonzero().flatten().tolist()
        if candidates:
            start = max(self.prompt_width, input_ids.shape[1] - self.window)
            tails = self.tokenizer.batch_decode(input_ids[candidates, start:], skip_special_tokens=False)
            for row, tail in zip(candidates, tails):
                done[row] = any(stop in tail for stop in self.stop_strings)
        return done


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    ids = ids if ids is not None else tokenizer.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def generated_length(ids: Sequence[int], tokenizer, stop_strings: Sequence[str], eos_ids: Sequence[int]) -> int:
    """How many of ``ids`` the model really generated: through the first EOS, or through the token that
    completed a stop string (``generate`` pads finished rows, and the pad id is often the EOS id)."""
    length = len(ids)
    for i, token in enumerate(ids):
        if token in eos_ids:
            length = i + 1
            break
    if not stop_strings:
        return length

    def has_stop(n: int) -> bool:
        text = tokenizer.decode(ids[:n], skip_special_tokens=False)
        return any(stop in text for stop in stop_strings)

    if not has_stop(length):
        return length
    low, high = 1, length  # smallest n with a stop string in decode(ids[:n]); decoding is monotone in n
    while low < high:
        middle = (low + high) // 2
        if has_stop(middle):
            high = middle
        else:
            low = middle + 1
    return low


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


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The chat template (user turn + generation prompt) when the tokenizer has one, else plain encoding."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def encode_observation(tokenizer, text: str, max_tokens: int) -> list[int]:
    """An env observation tokenised alone (no special tokens), cut to ``max_tokens`` as Search-R1 does."""
    return tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]


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
        obs_ids = encode_observation(tokenizer, observation, limits.max_observation_tokens)
        room = limits.max_total_tokens - len(trajectory.prompt_ids) - len(trajectory.response_ids)
        if len(obs_ids) >= room:  # no space left to generate after this observation
            trajectory.append(obs_ids[:room], policy=False, turn=turn)
            trajectory.done, trajectory.truncated, trajectory.finish_reason = True, True, "max_total_tokens"
            continue
        trajectory.append(obs_ids, policy=False, turn=turn)


def accepts_keyword(function: Callable, name: str) -> bool:
    """Whether ``function`` takes keyword ``name``: a parameter of that name, or ``**kwargs`` -- so that a wrapper
    around a backend's generate (timing, logging) does not silently lose what the backend needs."""
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def to_batch(trajectories: Sequence[Trajectory], pad_id: int) -> RolloutBatch:
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
