"""Prompt templates and observation formatting (Search-R1 conventions).

The QA template is Search-R1's ``make_prefix`` text for instruct models, verbatim; the MCQ variant adds the
options and asks for a letter. Templates are plain ``str.format`` strings with ``{question}`` (and
``{options}``) so users can pass their own; :func:`template_hash` identifies the one used in results.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

from .retrieval.base import Hit

SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)

SEARCH_R1_MCQ_TEMPLATE = (
    "Answer the given multiple-choice question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, you can call a "
    "search engine by <search> query </search> and it will return the top searched results between "
    "<information> and </information>. You can search as many times as your want. When you are ready, give "
    "the letter of the correct option inside <answer> and </answer>, for example <answer> B </answer>. "
    "Question: {question}\nOptions:\n{options}\n"
)


def format_options(choices: Mapping[str, str]) -> str:
    """One ``A. text`` line per option.

    >>> format_options({"A": "yes", "B": "no"})
    'A. yes\\nB. no'
    """
    return "\n".join(f"{letter}. {text}" for letter, text in choices.items())


def search_r1_question(question: str) -> str:
    """The question as Search-R1's data scripts put it into the prompt: stripped, ending in ``?``.

    >>> search_r1_question(" who wrote the iliad "), search_r1_question("Is it?"), search_r1_question("")
    ('who wrote the iliad?', 'Is it?', '')
    """
    question = question.strip()
    return question if not question or question.endswith("?") else question + "?"


def render_prompt(template: str, question: str, choices: Mapping[str, str] | None = None) -> str:
    """Fill a template with a question (and the options for MCQ)."""
    options = format_options(choices) if choices else ""
    return template.format(question=question, options=options)


def format_information(hits: Sequence[Hit]) -> str:
    """Search-R1's observation for a search: ``Doc i(Title: "t") text`` lines inside ``<information>``.

    >>> format_information([Hit("7", 1.5, "Paris", "Paris is the capital of France.")])
    '\\n\\n<information>Doc 1(Title: "Paris") Paris is the capital of France.</information>\\n\\n'
    """
    lines = "\n".join(f"Doc {i}(Title: {hit.display_title}) {hit.text}" for i, hit in enumerate(hits, start=1))
    return f"\n\n<information>{lines.strip()}</information>\n\n"


SEARCH_FAILURE_CHARS = 200
"""How much of a failed search's error message the agent sees (a Lucene message can run to kilobytes)."""


def search_failure_observation(error: BaseException) -> str:
    """The observation of a search that failed: Search-R1's empty ``<information>`` block, holding one line that
    says why, so that the agent (and a reader of the transcript) can tell a failed search from one that found
    nothing. The full message stays in ``info["error"]``.

    >>> search_failure_observation(ValueError("too many clauses"))
    '\\n\\n<information>Search failed: too many clauses</information>\\n\\n'
    """
    message = " ".join(str(error).split())[:SEARCH_FAILURE_CHARS] or type(error).__name__
    return f"\n\n<information>Search failed: {message}</information>\n\n"


def template_hash(*templates: str) -> str:
    """A short, stable id of the prompt templates in use (for result provenance)."""
    digest = hashlib.sha256("\x1f".join(templates).encode("utf-8")).hexdigest()
    return digest[:12]
