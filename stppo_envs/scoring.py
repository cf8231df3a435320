"""Answer scoring: normalisation, exact match, F1, multiple-choice letters.

Normalisation follows the official SQuAD v1.1 evaluation script (``normalize_answer`` in
``evaluate-v1.1.py``), which the NQ-open evaluation of DPR/FlashRAG/Search-R1 reuses: lower-case, drop
punctuation, drop the articles a/an/the, collapse white space. EM and F1 take the maximum over the golden
answers, as those scripts do. All functions are pure; the ``*_batch`` forms map them over lists.
"""

from __future__ import annotations

import collections
import re
import string
from typing import Mapping, Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD/NQ answer normalisation.

    >>> normalize_answer("The  Eiffel Tower!")
    'eiffel tower'
    >>> normalize_answer("An apple, a day")
    'apple day'
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def golden_list(golden_answers: str | Sequence[str]) -> list[str]:
    """A bare string is one answer (as in Search-R1's ``em_check``), not a sequence of one-letter answers.

    >>> golden_list("Paris"), golden_list(["Paris", "City of Light"])
    (['Paris'], ['Paris', 'City of Light'])
    """
    return [golden_answers] if isinstance(golden_answers, str) else list(golden_answers)


def exact_match(prediction: str | None, golden_answers: str | Sequence[str]) -> float:
    """1.0 when the normalised prediction equals any normalised golden answer.

    >>> exact_match("the Beatles", ["Beatles", "The Fab Four"])
    1.0
    >>> exact_match("Rolling Stones", ["Beatles"])
    0.0
    >>> exact_match(None, ["Beatles"])
    0.0
    >>> exact_match("P", "Paris"), exact_match("paris", "Paris")
    (0.0, 1.0)
    """
    if prediction is None:
        return 0.0
    normalized = normalize_answer(prediction)
    return float(any(normalized == normalize_answer(gold) for gold in golden_list(golden_answers)))


def _token_f1(prediction: str, gold: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, golden_answers: str | Sequence[str]) -> float:
    """Token-level F1 (SQuAD), maximised over the golden answers (a bare string is one answer).

    >>> f1_score("Eiffel Tower in Paris", ["the Eiffel Tower"])
    0.6666666666666666
    >>> f1_score("", ["x"])
    0.0
    >>> f1_score("a", "abc")
    0.0
    """
    golden = golden_list(golden_answers)
    if prediction is None or not golden:
        return 0.0
    return max(_token_f1(prediction, gold) for gold in golden)


_LETTER_PATTERNS = (
    re.compile(r"^\s*\(?([A-J])\)?\s*(?:[.:)\-]|$)"),  # "B", "(B)", "B.", "B) text", "B: text"
    re.compile(r"\b(?i:answer|option|choice)\s*(?i:is|:)?\s*\(?([A-J])\b\)?"),
)


def extract_choice(prediction: str | None, choices: Mapping[str, str]) -> str | None:
    """The option letter a free-text prediction names, or None.

    Tries, in order: a leading letter ("B", "(B) text", "B. text"), "answer is B", then the exact
    (normalised) text of exactly one option.

    >>> opts = {"A": "aspirin", "B": "insulin", "C": "warfarin"}
    >>> extract_choice("(B) insulin", opts), extract_choice("The answer is C", opts)
    ('B', 'C')
    >>> extract_choice("insulin", opts), extract_choice("no idea", opts)
    ('B', None)
    """
    if not prediction:
        return None
    for pattern in _LETTER_PATTERNS:
        match = pattern.search(prediction)
        if match and match.group(1).upper() in choices:
            return match.group(1).upper()
    normalized = normalize_answer(prediction)
    named = [letter for letter, text in choices.items() if normalize_answer(text) == normalized]
    return named[0] if len(named) == 1 else None


def choice_accuracy(prediction: str | None, choices: Mapping[str, str], answer_letter: str) -> float:
    """1.0 when the prediction names the correct option (by letter or by its text).

    >>> choice_accuracy("maybe", {"A": "yes", "B": "no", "C": "maybe"}, "C")
    1.0
    """
    return float(extract_choice(prediction, choices) == answer_letter)


def exact_match_batch(predictions: Sequence[str | None], golden: Sequence[Sequence[str]]) -> list[float]:
    """:func:`exact_match` over aligned lists.

    >>> exact_match_batch(["Paris", "Rome"], [["paris"], ["Milan"]])
    [1.0, 0.0]
    """
    _check_aligned(predictions, golden)
    return [exact_match(p, g) for p, g in zip(predictions, golden)]


def f1_score_batch(predictions: Sequence[str | None], golden: Sequence[Sequence[str]]) -> list[float]:
    """:func:`f1_score` over aligned lists.

    >>> f1_score_batch(["red car"], [["car"]])
    [0.6666666666666666]
    """
    _check_aligned(predictions, golden)
    return [f1_score(p, g) for p, g in zip(predictions, golden)]


def choice_accuracy_batch(
    predictions: Sequence[str | None], choices: Sequence[Mapping[str, str]], answers: Sequence[str]
) -> list[float]:
    """:func:`choice_accuracy` over aligned lists.

    >>> choice_accuracy_batch(["A", "b"], [{"A": "x", "B": "y"}] * 2, ["A", "A"])
    [1.0, 0.0]
    """
    _check_aligned(predictions, choices)
    _check_aligned(predictions, answers)
    return [choice_accuracy(p, c, a) for p, c, a in zip(predictions, choices, answers)]


def _check_aligned(left: Sequence, right: Sequence) -> None:
    if len(left) != len(right):
        raise ValueError(f"batch lengths differ: {len(left)} predictions vs {len(right)} references")
