"""A Text space for real language.

Gymnasium's ``Text`` with its default charset holds only letters and digits, so a prompt with a space or a
question mark fails ``check_env``. :class:`UnicodeText` contains any ``str`` within the length bound and
samples printable text salted with the action tags, which makes ``action_space.sample()`` a useful fuzzer.
"""

from __future__ import annotations

import string
from typing import Any

import numpy as np
from gymnasium.spaces import Text

_PRINTABLE = string.printable + "éüßñçøΩπ中文字"
_TAGS = ("<search>", "</search>", "<answer>", "</answer>", "<think>", "</think>", "<information>")


class UnicodeText(Text):
    """Any Unicode string of ``min_length`` to ``max_length`` characters."""

    def __init__(self, max_length: int, *, min_length: int = 0, seed: int | np.random.Generator | None = None):
        super().__init__(max_length=max_length, min_length=min_length, charset=_PRINTABLE, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """Printable text with action tags mixed in; at most 256 characters so that sampling stays cheap."""
        if mask is not None or probability is not None:
            return super().sample(mask=mask, probability=probability)
        upper = min(self.max_length, max(self.min_length, 256))
        pieces: list[str] = []
        length = 0
        target = int(self.np_random.integers(self.min_length, upper + 1))
        while length < target:
            if self.np_random.random() < 0.3:
                piece = _TAGS[int(self.np_random.integers(len(_TAGS)))]
            else:
                size = int(self.np_random.integers(1, 16))
                piece = "".join(self.np_random.choice(list(_PRINTABLE), size=size))
            pieces.append(piece)
            length += len(piece)
        text = "".join(pieces)[:target]
        return text + " " * (self.min_length - len(text))

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"
