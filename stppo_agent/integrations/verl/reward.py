"""A reward function for verl's ``reward.custom_reward_function`` that scores a response as the env does.

    reward.custom_reward_function.path=<site-packages>/stppo_agent/integrations/verl/reward.py
    reward.custom_reward_function.name=compute_score

verl hands over the decoded response of a whole episode (every assistant turn and every observation, as one
string), the row's ``reward_model.ground_truth`` and ``extra_info`` as :mod:`.data` wrote them. The turns are
recovered from the observations the env inserts between them (``<information>`` blocks, failed searches, the
invalid-action message; an ``<information>`` block the observation budget cut ends where the next turn opens a
tag), then replayed with the env's own rules: each turn's action is its first complete
``<search>``/``<answer>`` block (``stppo_envs.actions.parse_action``); the first answer ends the episode; turns past
``max_turns`` never happened; the answer is scored by exact match (QA) or by the option it names (multiple choice,
``stppo_envs.scoring``); ``format_reward`` as the env's. A turn holding a ``<tool_call>`` (verl's tool agent calls
the search tool that way) counts as a search, not as an invalid action. A response that ends with an observation
was cut by verl's length limit: it has no final turn and scores as a truncated episode.

Works without verl.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from stppo_envs import scoring
from stppo_envs.actions import INVALID_ACTION_MESSAGE, ActionType, parse_action

# An observation is a whole <information> block, or one the observation budget cut (the agent loop keeps its first
# max_observation_tokens tokens, as Search-R1 does, so its closing tag is gone): a cut block ends where the policy's
# next turn opens a tag, at the next observation, or at the end of the response. Text the policy writes before its
# first tag in that turn reads as part of the cut block; a passage that quotes a tag ends a cut block early.
_ACTION_TAG = r"<(?:think|search|answer|tool_call)>"
OBSERVATION = re.compile(r"<information>(?:(?!<information>).)*?</information>"
                         rf"|<information>(?:(?!<information>).)*?(?={_ACTION_TAG}|<information>|\Z)"
                         "|" + re.escape(INVALID_ACTION_MESSAGE.strip()), re.DOTALL)
TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


def split_turns(response: str) -> list[str]:
    """The assistant turns of a response: the text between observations (a trailing observation leaves none).

    >>> split_turns("<search> a </search>\\n\\n<information>Doc 1</information>\\n\\n<answer> b </answer>")
    ['<search> a </search>\\n\\n', '\\n\\n<answer> b </answer>']
    """
    pieces = OBSERVATION.split(response)
    return pieces[:-1] if len(pieces) > 1 and not pieces[-1].strip() else pieces


def replay(response: str, max_turns: int) -> tuple[str | None, int, int]:
    """(the answer that ended the episode, or None; invalid actions; turns taken) under the env's rules."""
    invalid = 0
    turns = split_turns(response)[:max_turns]
    for number, text in enumerate(turns, start=1):
        parsed = parse_action(text)
        if parsed.type is ActionType.ANSWER:
            return parsed.content, invalid, number
        if parsed.type is ActionType.INVALID and not TOOL_CALL.search(text):
            invalid += 1
    return None, invalid, len(turns)


def compute_score(data_source: str, solution_str: str, ground_truth: Mapping[str, Any],
                  extra_info: Mapping[str, Any] | None = None, max_turns: int | None = None,
                  reward: str | None = None, format_reward: float | None = None, **_: Any) -> dict[str, float]:
    """``{"score": the env's reward, ...}``; keyword arguments (``reward_kwargs`` in verl's config) override the
    env settings recorded in ``extra_info``."""
    extra_info = extra_info or {}
    max_turns = int(max_turns if max_turns is not None else extra_info.get("max_turns") or 4)
    reward = reward or extra_info.get("reward") or "auto"
    format_reward = float(format_reward if format_reward is not None else extra_info.get("format_reward") or 0.0)
    prediction, invalid, turns = replay(solution_str, max_turns)
    choices = {c["letter"]: c["text"] for c in ground_truth.get("choices") or []}
    golden = list(ground_truth["target"])
    if choices:
        correct = scoring.choice_accuracy(prediction, choices, ground_truth["answer_letter"])
        scores = {"acc": correct, "em": correct, "f1": correct}
    else:
        scores = {"em": scoring.exact_match(prediction, golden), "f1": scoring.f1_score(prediction, golden)}
        scores["acc"] = scores["em"]
    name = reward if reward != "auto" else ("acc" if choices else "em")
    format_ok = float(prediction is not None and invalid == 0)
    score = scores[name] * (1.0 - format_reward) + format_reward * format_ok
    return {"score": score, **scores, "answered": float(prediction is not None), "invalid_actions": float(invalid),
            "turns": float(turns)}
