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
    """Say the target word in every turn. ``fixed_target`` makes the target the same in every episode."""

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
