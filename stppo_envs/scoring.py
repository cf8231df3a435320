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

SCORING_VERSION = 2
"""Bump when the score of some answer changes. ``stppo eval`` records it in each result's provenance, so ``stppo
compare`` refuses results scored by different versions (a result without it predates 2). 2: F1 scores a yes/no
answer or gold all or nothing (HotpotQA's and FlashRAG's rule); a letter beside its own option's text ("B
(insulin)"), in nested LaTeX (``$\\boxed{\\text{B}}$``) or before a dash names that option."""

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


# HotpotQA's official F1 (hotpot_evaluate_v1.py), which FlashRAG's F1 and 2Wiki's reuse: a yes/no answer is right
# or wrong, so it earns nothing unless it equals the gold exactly -- else the hedge "yes no" would get 2/3 on
# every yes/no question, and a reward=f1 policy would learn to give it.
_ALL_OR_NOTHING = frozenset({"yes", "no", "noanswer"})


def _token_f1(prediction: str, gold: str) -> float:
    normalized_prediction, normalized_gold = normalize_answer(prediction), normalize_answer(gold)
    if normalized_prediction != normalized_gold and (
            normalized_prediction in _ALL_OR_NOTHING or normalized_gold in _ALL_OR_NOTHING):
        return 0.0
    pred_tokens = normalized_prediction.split()
    gold_tokens = normalized_gold.split()
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, golden_answers: str | Sequence[str]) -> float:
    """Token-level F1 (SQuAD), maximised over the golden answers (a bare string is one answer); a yes/no answer or
    gold scores 1 or 0 (HotpotQA's and FlashRAG's rule: ``"yes no"`` is no partly right answer to ``"yes"``).

    >>> f1_score("Eiffel Tower in Paris", ["the Eiffel Tower"])
    0.6666666666666666
    >>> f1_score("", ["x"])
    0.0
    >>> f1_score("a", "abc"), f1_score("yes no", "yes")
    (0.0, 0.0)
    """
    golden = golden_list(golden_answers)
    if prediction is None or not golden:
        return 0.0
    return max(_token_f1(prediction, gold) for gold in golden)


# Markup a chat model wraps an answer in: emphasis and code marks, LaTeX ``\\boxed{..}``/``\\text{..}``,
# headings and quotes. None of these characters survives normalize_answer, so removing them changes no
# option-text comparison.
_LATEX_WRAPPER = re.compile(r"\\(?:boxed|text|textbf|mathrm|mathbf)\{([^{}]*)\}")
_MARKUP_CHARS = re.compile(r"[*_`$]")
_LINE_PREFIX = re.compile(r"^\s*(?:#+|>)\s+", re.MULTILINE)  # "> B", "## B"; not ">50 degree"
# "B", "(b)", "[B]", "{c}", "b." -- nothing but one letter.
_BARE_LETTER = re.compile(r"^[(\[{]?\s*([A-Za-z])\s*[)\]}]?\s*[.:!]?$")
# "(b) text", "[B] text" -- a bracketed letter then anything.
_BRACKETED_LETTER = re.compile(r"^[(\[{]\s*([A-Za-z])\s*[)\]}](?=\s|[.:,;]|$)")
# "B. text", "b) text", "B: text", "B - text", "B – text": the delimiter must be followed by white space, so
# "B-cell", "C.difficile" and "e.g." are words, not letters.
_DELIMITED_LETTER = re.compile(r"^([A-Za-z])(?:[.:)]|\s*[-\u2013\u2014])(?=\s|$)")
# A letter beside its own option's text, in either order: "B (insulin)", "B insulin", "B—insulin", "insulin (B)".
_LETTER_FIRST = re.compile(r"^[(\[{]?\s*([A-Za-z])(?:\s*[)\]}]|\s*[-\u2013\u2014.:,]|\s)\s*(.+)$", re.DOTALL)
_LETTER_LAST = re.compile(r"^(.+?)\s*[-\u2013\u2014:,]?\s*[(\[{]\s*([A-Za-z])\s*[)\]}]\s*[.!]?$", re.DOTALL)
# After "answer is": "B because ...", "b, since ..." also name a letter.
_LETTER_THEN_WORD = re.compile(r"^([A-Za-z])(?=[,;!?]|\s+\S)")
_WORDS_NOT_LETTERS = frozenset("aAI")  # "a drug", "A drug", "I think": an article or pronoun, not an option
# "A or B", "a, c", "A/B", "B and C": a hedge names no single option.
_HEDGE = re.compile(r"^[(\[]?[A-Za-z][)\]]?\s*(?:,|/|&|\bor\b|\band\b)\s*[(\[]?[A-Za-z]\b")
_ANSWER_LEAD_IN = re.compile(r"\banswer\s*(?:(?:is|would be|will be|should be)\b)?\s*[:\-\u2013\u2014]?\s*",
                             re.IGNORECASE)
_OPTION_LEAD_IN = re.compile(r"\b(?:option|choice)\s*(?:(?:is|would be|will be|should be)\b)?\s*[:\-\u2013\u2014]?\s*",
                             re.IGNORECASE)


def _strip_markup(text: str) -> str:
    unwrapped = None
    while unwrapped != text:  # nested wrappers, innermost first: \boxed{\text{B}}
        unwrapped, text = text, _LATEX_WRAPPER.sub(r"\1", text)
    text = _LINE_PREFIX.sub("", _MARKUP_CHARS.sub("", text))
    return text.strip()


def _verbatim(text: str) -> str:
    return " ".join(_MARKUP_CHARS.sub("", text).casefold().split()).rstrip(".").strip()


def _named_choice(text: str, choices: Mapping[str, str], after_lead_in: bool) -> str | None:
    """The option ``text`` names by itself (the whole prediction, or what follows "the answer is")."""
    text = text.strip()
    bare = _BARE_LETTER.match(text.split("\n", 1)[0].strip())  # "B" alone on the first line, reasons below
    if bare and bare.group(1).upper() in choices:
        return bare.group(1).upper()
    # Verbatim (up to case, spacing and a final period) first: SQuAD normalisation drops punctuation, which
    # merges options such as "Rh+ve"/"Rh-ve" or "15.6"/"156" (MedMCQA, MMLU).
    for key in (_verbatim, normalize_answer):
        wanted = key(text)
        named = [letter for letter, option in choices.items() if wanted and key(option) == wanted]
        if len(named) == 1:
            return named[0]
    if _HEDGE.match(text):
        return None
    for found, letter_at, text_at in ((_LETTER_FIRST.match(text), 1, 2), (_LETTER_LAST.match(text), 2, 1)):
        if found and found.group(letter_at).upper() in choices:
            own = normalize_answer(choices[found.group(letter_at).upper()])
            if own and normalize_answer(found.group(text_at)) == own:
                return found.group(letter_at).upper()
    match = _BRACKETED_LETTER.match(text) or _DELIMITED_LETTER.match(text)
    if match is None and after_lead_in:
        match = _LETTER_THEN_WORD.match(text)
        if match and match.group(1) in _WORDS_NOT_LETTERS and not re.match(r"^.[,;!?]", text):
            match = None
    if match and match.group(1).upper() in choices:
        return match.group(1).upper()
    return None


def extract_choice(prediction: str | None, choices: Mapping[str, str]) -> str | None:
    """The option letter a free-text prediction names, or None.

    Markup is dropped first (``**B**``, ``*B*``, `` `B` ``, ``$\\boxed{B}$``, ``\\boxed{\\text{B}}``,
    ``# B``). Then, on the whole prediction, the first rule that names an option decides:

    1. nothing but one letter, in either case, optionally bracketed or followed by ``.``/``:``: ``B``, ``b``,
       ``(b)``, ``[B]``, ``b.``, or such a letter alone on the first line -- the letter, even where some
       option's text is that letter (blood groups): the prompt asks for the letter;
    2. the whole text of exactly one option: ``C. difficile``, ``B-cell lymphoma``, ``D-dimer`` are those
       options, not letters C, B, D. Compared verbatim up to case, spacing and a final period first (so
       ``Rh-ve`` is not ``Rh+ve``, nor ``15.6`` ``156``), then SQuAD-normalised (punctuation and articles
       do not count) where that names exactly one option;
    3. a letter beside its own option's text, in either order (``B (insulin)``, ``B insulin``, ``B—insulin``,
       ``insulin (B)``); else a leading letter, either case, bracketed (``(b) text``) or followed by ``.``,
       ``)``, ``:`` or a dash (`` -``, `` –``) and white space (``B. text``, ``b) text``); ``B-cell`` and
       ``e.g.`` are words, not letters;
    4. the same rules on what follows the last "answer is" / "answer:" phrase (``The answer is b``,
       ``Final answer: **B**``, ``the answer is insulin``), else the last "option" / "choice" phrase
       (``the correct option is C``); there a letter followed by a word also counts (``the answer is B
       because ...``).

    A lone ``a`` (also ``(a)``, ``a.``, ``a) text``, ``the answer is a.``) is option A: as a whole answer the
    article means nothing. ``a`` followed by a word is the article (``a beta blocker`` is matched by
    option text or not at all), and so is ``A`` -- ``I`` likewise is the pronoun there. A hedge naming
    several letters (``A or B``, ``A, B``, ``A/B``) names none. Unreadable answers are None (scored 0).

    Relation to the references: Search-R1 defines no multiple-choice scoring; FlashRAG scores MCQ sets by
    exact match against the golden option's *text* (rule 2); MIRAGE's ``locate_answer`` reads upper-case
    leading letters and "Option X" (rules 1, 3, 4) but takes the first letter of a hedge and falls back to
    "A" when nothing matches, which would reward unreadable answers.

    >>> opts = {"A": "aspirin", "B": "insulin", "C": "warfarin"}
    >>> extract_choice("(B) insulin", opts), extract_choice("The answer is c", opts), extract_choice("**b**", opts)
    ('B', 'C', 'B')
    >>> extract_choice("insulin", opts), extract_choice("no idea", opts), extract_choice("A or B", opts)
    ('B', None, None)
    >>> extract_choice("C. difficile", {"A": "E. coli", "B": "S. aureus", "C": "H. pylori", "D": "C. difficile"})
    'D'
    """
    if not prediction:
        return None
    text = _strip_markup(prediction)
    named = _named_choice(text, choices, after_lead_in=False)
    if named is not None:
        return named
    for lead_in in (_ANSWER_LEAD_IN, _OPTION_LEAD_IN):
        matches = list(lead_in.finditer(text))
        named = _named_choice(text[matches[-1].end():], choices, after_lead_in=True) if matches else None
        if named is not None:
            return named
    return None


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
