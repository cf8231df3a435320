"""The one record type every benchmark adapter produces."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


class DatasetFormatError(ValueError):
    """A dataset file or record does not have the fields its benchmark needs."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One question of any benchmark.

    ``golden_answers`` holds the accepted answer strings (for MCQ: the correct option's text and letter);
    ``choices`` maps option letters to texts and ``answer_letter`` is the correct one (MCQ only).
    """

    id: str
    question: str
    golden_answers: tuple[str, ...]
    benchmark: str
    choices: Mapping[str, str] | None = None
    answer_letter: str | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def is_multiple_choice(self) -> bool:
        return self.choices is not None

    def __post_init__(self):
        if not self.question or not self.question.strip():
            raise DatasetFormatError(f"example {self.id!r} of {self.benchmark} has an empty question")
        if not self.golden_answers:
            raise DatasetFormatError(f"example {self.id!r} of {self.benchmark} has no golden answer")
        if self.choices is not None and self.answer_letter not in self.choices:
            raise DatasetFormatError(
                f"example {self.id!r} of {self.benchmark}: answer {self.answer_letter!r} is not one of the "
                f"options {sorted(self.choices)}"
            )

    def to_dict(self) -> dict[str, Any]:
        """FlashRAG-style record (``id``, ``question``, ``golden_answers``) plus our MCQ fields."""
        record = dataclasses.asdict(self)
        record["golden_answers"] = list(self.golden_answers)
        record["choices"] = dict(self.choices) if self.choices is not None else None
        record["metadata"] = dict(self.metadata)
        return record
