"""``stppo/Copy-v0``: repeat a sequence of symbols, turn after turn -- a tier where a turn is many tokens, all read.

Unlike ``stppo/Toy-v0`` (one decisive word per turn), every generated word of a turn counts here, so a turn's
ratio (the geometric mean over its tokens) and its tokens' own ratios differ: the regime the turn-level rules are
about, small enough for a CPU.

The spaces, rewards and episodes are described in :class:`CopyEnv`.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from .env import Segment
from .spaces import UnicodeText

COPY_ENV_ID = "stppo/Copy-v0"
CUE = "copy"
INDEX_STREAM = 0xC0B1  # the indexed episodes' own random stream, apart from any reset seed


def copy_symbols(vocabulary: int = 64) -> tuple[str, ...]:
    """The env's symbols: ``s00`` .. ``s63`` for 64 (zero-padded, so every symbol is one word of the same shape)."""
    width = max(2, len(str(vocabulary - 1)))
    return tuple(f"s{i:0{width}d}" for i in range(vocabulary))


class CopyEnv(gym.Env[str, str]):
    """``stppo/Copy-v0``: repeat the shown sequence of ``length`` symbols in each of ``turns`` turns.

    ## Description
    Each turn the env shows ``length`` symbols; the policy's action must repeat them, whitespace-separated. The
    env reads the whole action, position by position.

    ## Action Space
    ``UnicodeText``: the policy's text for the turn, read whole as whitespace-separated words.

    ## Observation Space
    ``UnicodeText``: ``"copy"`` followed by ``length`` symbols (``s00`` .. ``s63`` for 64), separated by spaces. The
    prompt shows the first turn's sequence; each later turn's sequence is the observation after the previous turn.

    ## Rewards
    0 until the last turn; then the mean over the turns of the per-position accuracy: the share of the ``length``
    positions whose word is the shown symbol (partial credit). A uniformly random policy over the symbols scores
    ``1 / vocabulary``.

    ## Starting State
    ``turns`` sequences of ``length`` symbols drawn uniformly (with repeats): from the env's random generator
    (``reset(seed=...)`` fixes them), or with ``reset(options={"index": i})`` from a generator seeded by ``i`` alone,
    so that the ``prompts`` indexed episodes are fixed questions (a trainer resets every sample of one prompt, a GRPO
    group, with the same index).

    ## Episode End
    Terminated after ``turns`` steps; never truncated by the env (a trainer's ``max_turns`` may cut it).

    ## Information
    Every step: ``turn``, ``accuracy`` (this turn's), ``invalid_actions`` (turns so far whose action had a word
    outside the symbols or not exactly ``length`` words), ``action_type`` (``invalid``, ``move`` or, on the last
    turn, ``answer``), ``segments``; ``search_calls`` and ``search_errors`` are 0. The last step adds
    ``prediction`` (its action), ``golden_answers`` (its sequence), ``em`` (every position of every turn right) and
    ``f1`` (the reward). ``reset`` returns ``messages``, ``example_id``, ``benchmark`` ``"copy"``, ``turn`` 0,
    ``segments`` and ``question`` (the prompt).

    ## Arguments
    ``length`` (16): symbols per turn. ``vocabulary`` (64): distinct symbols, 2 to 1000. ``turns`` (2): turns per
    episode. ``prompts`` (100000): how many indexed episodes ``options={"index": i}`` poses (``i`` modulo it; the
    env's ``prompt_count``). ``render_mode``: ``"ansi"`` renders the transcript.

    ## Version History
    - v0: the first version.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, length: int = 16, vocabulary: int = 64, turns: int = 2, prompts: int = 100_000,
                 render_mode: str | None = None):
        if length < 1 or turns < 1 or not 2 <= vocabulary <= 1000 or prompts < 1:
            raise ValueError(f"need length >= 1, turns >= 1, 2 <= vocabulary <= 1000 and prompts >= 1; got "
                             f"length={length}, turns={turns}, vocabulary={vocabulary}, prompts={prompts}")
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ValueError(f"render_mode must be None or ansi, got {render_mode!r}")
        self.length, self.turns, self.render_mode = length, turns, render_mode
        self.prompt_count = prompts
        self.symbols = copy_symbols(vocabulary)
        self._known = frozenset(self.symbols)
        bound = len(CUE) + (len(self.symbols[-1]) + 1) * length + 2
        self.observation_space = UnicodeText(bound)
        self.action_space = UnicodeText(4096)
        self.sequences: list[tuple[str, ...]] = []
        self.transcript: list[Segment] = []
        self._turn, self._accuracies, self._invalid, self._done = 0, [], 0, True

    def _show(self, turn: int) -> str:
        return " ".join((CUE, *self.sequences[turn]))

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        generator = self.np_random
        if options and "index" in options:
            generator = np.random.default_rng([INDEX_STREAM, int(options["index"]) % self.prompt_count])
        draws = generator.integers(len(self.symbols), size=(self.turns, self.length))
        self.sequences = [tuple(self.symbols[int(i)] for i in row) for row in draws]
        self._turn, self._accuracies, self._invalid, self._done = 0, [], 0, False
        prompt = self._show(0)
        self.transcript = [Segment("user", prompt, -1)]
        info = {"messages": [{"role": "user", "content": prompt}], "example_id": "copy-" + "-".join(self.sequences[0]),
                "benchmark": "copy", "turn": 0, "segments": list(self.transcript), "question": prompt,
                "choices": None}
        return prompt, info

    def step(self, action: str):
        if self._done:
            raise RuntimeError("the episode is over (or was never started): call reset() before step()")
        turn, target = self._turn, self.sequences[self._turn]
        words = action.split() if isinstance(action, str) else []
        accuracy = sum(word == symbol for word, symbol in zip(words, target)) / self.length
        valid = len(words) == self.length and all(word in self._known for word in words)
        self._invalid += not valid
        self._accuracies.append(accuracy)
        self._turn += 1
        terminated = self._turn >= self.turns
        self._done = terminated
        observation = "" if terminated else f" {self._show(self._turn)} "
        reward = sum(self._accuracies) / self.turns if terminated else 0.0
        segments = [Segment("assistant", action if isinstance(action, str) else repr(action), turn),
                    Segment("environment", observation, turn)]
        self.transcript.extend(segments)
        info = {"turn": self._turn, "accuracy": accuracy, "invalid_actions": self._invalid,
                "action_type": "invalid" if not valid else "answer" if terminated else "move",
                "segments": segments, "search_calls": 0, "search_errors": 0}
        if terminated:
            info.update(prediction=" ".join(words), golden_answers=[" ".join(target)],
                        em=float(all(a == 1.0 for a in self._accuracies)), f1=reward)
        return observation, reward, terminated, False, info

    def render(self):
        if self.render_mode == "ansi":
            return "".join(segment.text for segment in self.transcript)
        return None
