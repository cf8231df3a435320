"""Parsing of one turn's action text, with Search-R1 semantics.

Search-R1 (``search_r1/llm_agent/generation.py::postprocess_predictions``) takes the *first complete*
``<search>...</search>`` or ``<answer>...</answer>`` block of a turn: ``re.search(r"<(search|answer)>(.*?)</\\1>")``.
``<think>`` blocks are free text. Anything else is an invalid action, answered with Search-R1's corrective
message. Every input string has a defined outcome; parsing never raises.
"""

from __future__ import annotations

import dataclasses
import enum
import re

MAX_QUERY_CHARS = 4096
"""Queries longer than this are invalid (a runaway generation, not a query; BM25 cost grows with length). Long
enough for a whole MedQA vignette, which a search-the-question baseline sends."""

INVALID_ACTION_MESSAGE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
"""Search-R1's observation for an invalid action, verbatim, so trained policies see what they were trained on."""

MAX_ACTION_CHARS = 65536
"""Longer turns are invalid actions: a runaway generation, not an action (and parsing stays cheap)."""

_OPEN_TAG = re.compile(r"<(search|answer)>")
_ANY_TAG = re.compile(r"</?(?:search|answer)>")


def _first_complete_block(text: str) -> tuple[str, str] | None:
    """(kind, content) of the leftmost ``<k>`` that has a ``</k>`` after it, with the first such ``</k>`` -- what
    ``re.search(r"<(search|answer)>(.*?)</\\1>", text, re.DOTALL)`` returns -- in linear time (that regex
    rescans the rest of the text from every unclosed opening tag: quadratic on repeated tags)."""
    last_close = {kind: text.rfind(f"</{kind}>") for kind in ("search", "answer")}
    for match in _OPEN_TAG.finditer(text):
        kind = match.group(1)
        if last_close[kind] >= match.end():
            close = text.find(f"</{kind}>", match.end())
            return kind, text[match.end():close]
    return None


class ActionType(str, enum.Enum):
    SEARCH = "search"
    ANSWER = "answer"
    INVALID = "invalid"


@dataclasses.dataclass(frozen=True)
class ParsedAction:
    """The decision of one turn. ``content`` is the stripped query or answer ('' when invalid)."""

    type: ActionType
    content: str = ""
    reason: str = ""  # why an action is invalid, for logs and info["invalid_reason"]


def parse_action(text: str) -> ParsedAction:
    """Parse a turn's text into a search, an answer or an invalid action.

    >>> parse_action("<think>hm</think><search> capital of France </search>")
    ParsedAction(type=<ActionType.SEARCH: 'search'>, content='capital of France', reason='')
    >>> parse_action("<answer>Paris</answer><search>x</search>").type.value
    'answer'
    >>> parse_action("<search>unclosed").reason
    'no complete <search>...</search> or <answer>...</answer> block'
    >>> parse_action("<search><answer>x</answer></search>").reason
    'nested action tags'
    """
    if not isinstance(text, str):
        return ParsedAction(ActionType.INVALID, reason=f"action must be str, got {type(text).__name__}")
    if len(text) > MAX_ACTION_CHARS:
        return ParsedAction(ActionType.INVALID, reason=f"action longer than {MAX_ACTION_CHARS} characters")
    block = _first_complete_block(text)
    if block is None:
        return ParsedAction(ActionType.INVALID, reason="no complete <search>...</search> or <answer>...</answer> block")
    kind, content = block
    if _ANY_TAG.search(content):
        return ParsedAction(ActionType.INVALID, reason="nested action tags")
    content = content.strip()
    if not content:
        return ParsedAction(ActionType.INVALID, reason=f"empty <{kind}> block")
    if kind == "search" and len(content) > MAX_QUERY_CHARS:
        return ParsedAction(ActionType.INVALID, reason=f"query longer than {MAX_QUERY_CHARS} characters")
    return ParsedAction(ActionType(kind), content)
