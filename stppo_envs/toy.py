"""``stppo/Toy-v0``: a tiny multi-turn env on which a policy can be seen to learn in seconds on a CPU.

Each episode lasts ``turns`` steps. The prompt names a target word; after every turn but the last the env
answers ``ok``; the outcome reward, given at the end, is the fraction of turns whose action was the target word.
A uniformly random policy over ``choices`` words scores 1/len(choices); the best policy scores 1. Learning it
needs credit assignment over turns and exactly the right loss mask, so the trainer's learning test uses it.

``reward_flip_episodes=(start, stop)`` corrupts the reward on purpose: episodes ``start`` to ``stop - 1`` of an env
instance (counted from 0 since it was made; a trainer plays one episode per env instance per iteration) pay for
*not* saying the target. A policy that follows it forgets the task and, having lost its entropy, may never find it
again: a known, reproducible collapse to test the trainer's collapse monitors and rollback against.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from .env import Segment
from .spaces import UnicodeText

DEFAULT_CHOICES = ("red", "green", "blue", "gold")


class ToyTargetEnv(gym.Env[str, str]):
    """Say the target word in every turn: a multi-turn env a policy learns in seconds on a CPU.

    ## Description

    The prompt names a target word (``say red``); the policy is paid for saying it, once per turn, for ``turns``
    turns. Registered as ``stppo/Toy-v0`` (``stppo_envs.TOY_ENV_ID``). A uniformly random policy over ``choices``
    scores 1/len(choices), the best policy 1. Learning it needs credit assignment over turns and exactly the right
    loss mask, which is what the trainer's learning tests check; ``--model tiny`` (a 2-layer model whose
    vocabulary is these words) learns it.

    ## Action Space

    ``UnicodeText(1024)``: any ``str`` of up to 1,024 characters. Only its first whitespace-separated word counts;
    it is compared with the target exactly.

    ## Observation Space

    ``UnicodeText(1024)``. After ``reset``: ``say TARGET``. After every turn but the last: `` ok ``. After the last:
    ``""``.

    ## Rewards

    0 on every step but the last; on the last, the fraction of the episode's turns whose first word was the target
    (so 0, 1/turns, ..., 1). With ``reward_flip_episodes=(start, stop)``, episodes ``start`` to ``stop - 1`` of the
    instance pay for turns that did *not* say the target instead: a reward corrupted on purpose, to test collapse
    monitors and rollback against a known collapse.

    ## Starting State

    The target is ``fixed_target`` (``red`` by default) in every episode. With ``fixed_target=None``:
    ``choices[index % len(choices)]`` for ``reset(options={"index": index})``, else a choice drawn from the env's
    generator (``reset(seed=s)`` seeds it).

    ## Episode End

    Termination after ``turns`` steps; never truncated. ``step`` after the end raises until ``reset``.

    ## Information

    ``reset`` returns ``messages``, ``example_id`` (``toy-TARGET``), ``benchmark`` (``toy``), ``turn`` (0),
    ``segments``, ``question`` (the prompt) and ``choices`` (None), as the search envs do. Every ``step`` returns
    ``turn`` (turns completed), ``action_type`` (``move``, or ``answer`` on the last turn), ``segments`` and the
    search envs' counters ``search_calls``, ``invalid_actions`` and ``search_errors`` (always 0); the last step
    adds ``prediction`` (the word said), ``golden_answers`` ([target]), ``em`` (1 when every turn said it) and
    ``f1`` (the reward).

    Turn boundaries as in the search envs: the k-th call of ``step`` (from 0) is turn k; ``info["segments"]``
    holds the ``(role, text, turn)`` pieces it appended, the action (``assistant``) and the observation
    (``environment``), both with ``turn=k``, and ``info["turn"]`` is ``k + 1``.

    ## Arguments

    - ``turns`` (2): steps per episode (>= 1).
    - ``choices`` (red, green, blue, gold): the words a target is drawn from (at least two).
    - ``fixed_target`` (``red``): the target of every episode; None draws one per episode.
    - ``reward_flip_episodes`` (None): ``(start, stop)``, the episodes of this instance (counted from 0) whose
      reward is flipped; a trainer plays one episode per env instance per iteration.
    - ``render_mode``: None or ``ansi`` (``render()`` returns the transcript so far).

    ## Version History

    - v0: the first version.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, turns: int = 2, choices: tuple[str, ...] = DEFAULT_CHOICES, fixed_target: str | None = "red",
                 render_mode: str | None = None, reward_flip_episodes: tuple[int, int] | list[int] | None = None):
        if turns < 1 or len(choices) < 2:
            raise ValueError("need turns >= 1 and at least two choices")
        if fixed_target is not None and fixed_target not in choices:
            raise ValueError(f"fixed_target {fixed_target!r} is not one of {choices}")
        self.turns, self.choices, self.fixed_target, self.render_mode = turns, tuple(choices), fixed_target, render_mode
        if reward_flip_episodes is not None and (len(reward_flip_episodes) != 2
                                                 or not 0 <= reward_flip_episodes[0] <= reward_flip_episodes[1]):
            raise ValueError(f"reward_flip_episodes must be [start, stop) with 0 <= start <= stop, got "
                             f"{reward_flip_episodes!r}")
        self.reward_flip_episodes = tuple(reward_flip_episodes) if reward_flip_episodes is not None else None
        self.episodes = 0  # episodes started by this instance
        self.observation_space = UnicodeText(1024)
        self.action_space = UnicodeText(1024)
        self.target = fixed_target or choices[0]
        self.transcript: list[Segment] = []
        self._turn, self._hits, self._done, self._flipped = 0, 0, True, False

    @property
    def prompt_count(self) -> int:
        """Distinct prompts ``reset(options={"index": i})`` poses: one per choice when the target is drawn, else 1
        (a trainer's prompt sampler walks them, so a drawn target varies across a batch)."""
        return 1 if self.fixed_target is not None else len(self.choices)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        if self.fixed_target is not None:
            self.target = self.fixed_target
        elif "index" in options:
            self.target = self.choices[int(options["index"]) % len(self.choices)]
        else:
            self.target = self.choices[int(self.np_random.integers(len(self.choices)))]
        self._turn, self._hits, self._done = 0, 0, False
        self._flipped = self.reward_flip_episodes is not None and \
            self.reward_flip_episodes[0] <= self.episodes < self.reward_flip_episodes[1]
        self.episodes += 1
        prompt = f"say {self.target}"
        self.transcript = [Segment("user", prompt, -1)]
        info = {"messages": [{"role": "user", "content": prompt}], "example_id": f"toy-{self.target}",
                "benchmark": "toy", "turn": 0, "segments": list(self.transcript), "question": prompt, "choices": None}
        return prompt, info

    def step(self, action: str):
        if self._done:
            raise RuntimeError("the episode is over (or was never started): call reset() before step()")
        turn = self._turn
        self._turn += 1
        said = action.split()[0] if isinstance(action, str) and action.split() else ""
        self._hits += int((said == self.target) != self._flipped)
        terminated = self._turn >= self.turns
        observation = "" if terminated else " ok "
        reward = self._hits / self.turns if terminated else 0.0
        self._done = terminated
        segments = [Segment("assistant", action if isinstance(action, str) else repr(action), turn),
                    Segment("environment", observation, turn)]
        self.transcript.extend(segments)
        info = {"turn": self._turn, "action_type": "answer" if terminated else "move", "segments": segments,
                "search_calls": 0, "invalid_actions": 0, "search_errors": 0}
        if terminated:
            info.update(prediction=said, golden_answers=[self.target], em=float(self._hits == self.turns),
                        f1=reward)
        return observation, reward, terminated, False, info

    def render(self):
        if self.render_mode == "ansi":
            return "".join(segment.text for segment in self.transcript)
        return None
