"""A reward function for verl's ``reward.custom_reward_function`` (and ``verl.trainer.main_eval``) that scores a
response as the env does.

    reward.custom_reward_function.path=<site-packages>/stppo_agent/integrations/verl/reward.py
    reward.custom_reward_function.name=compute_score          # the score, a float
    reward.custom_reward_function.name=compute_score_details  # a dict: the score, em, f1, acc, answered, ...

The turns come from what the agent loop recorded, never from the text: the bridge's loops (``stppo_env``,
``stppo_tool_agent``) put each assistant turn's text in ``extra_fields["stppo_turn_texts"]``, which verl's reward loop
hands over inside ``extra_info`` (:mod:`.turns`). An ``<information>`` block the policy wrote is then text of its
turn, as the env reads it. A response without that record is one turn (a single-turn generation, as ``main_eval``
scores them); one that verl reports as multi-turn (``extra_info["num_turns"] > 2``) without the record is refused:
its turn boundaries are not in the text.

The turns are replayed with the env's rules: each turn's action is its first complete ``<search>``/``<answer>``
block (``stppo_envs.actions.parse_action``), or a ``<tool_call>`` block (verl's tool agent searches that way) when
one comes first; the first answer ends the episode; turns past ``max_turns`` never happened; the answer is scored by
exact match (QA) or by the option it names (multiple choice, ``stppo_envs.scoring``); ``format_reward`` as the
env's. The ground truth may come as :mod:`.data` wrote it or as pandas reads the parquet (numpy arrays).

Works without verl.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from stppo_agent.integrations.verl.turns import TURN_TEXTS  # absolute: verl loads this file by its path
from stppo_envs import scoring
from stppo_envs.actions import ActionType, ParsedAction, parse_action

TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


class TurnsNotRecordedError(ValueError):
    """A multi-turn response without the turn record of the bridge's agent loops."""


def turn_action(text: str) -> ParsedAction:
    """One turn's action: the env's parse, with a complete ``<tool_call>`` block read as a search when it comes
    before the turn's first complete search or answer block."""
    call = TOOL_CALL.search(text)
    if call is None:
        return parse_action(text)
    before = parse_action(text[:call.start()])
    return before if before.type is not ActionType.INVALID else ParsedAction(ActionType.SEARCH, "tool call")


def replay(turns: Sequence[str], max_turns: int) -> tuple[str | None, int, int]:
    """(the answer that ended the episode, or None; invalid actions; turns taken) under the env's rules."""
    invalid = 0
    turns = list(turns)[:max_turns]
    for number, text in enumerate(turns, start=1):
        action = turn_action(text)
        if action.type is ActionType.ANSWER:
            return action.content, invalid, number
        invalid += action.type is ActionType.INVALID
    return None, invalid, len(turns)


def recorded_turns(solution_str: str, extra_info: Mapping[str, Any]) -> list[str]:
    """The response's assistant turns: the agent loop's record, else the whole response as one turn."""
    texts = extra_info.get(TURN_TEXTS)
    if texts is not None:
        return [str(text) for text in texts]
    num_turns = extra_info.get("num_turns")
    if num_turns is not None and int(num_turns) > 2:
        raise TurnsNotRecordedError(
            f"compute_score: verl reports a response of {int(num_turns)} turns (messages) without the turn record "
            f"({TURN_TEXTS}) that the stppo_env and stppo_tool_agent agent loops write, and turn boundaries cannot be "
            "read from the text; export the rows with one of those loops (stppo export verl --agent-loop)")
    return [solution_str]


def _as_list(value) -> list:
    return [] if value is None else list(value)  # a list, a tuple or the numpy array pandas reads


def compute_score_details(data_source: str, solution_str: str, ground_truth: Mapping[str, Any],
                          extra_info: Mapping[str, Any] | None = None, max_turns: int | None = None,
                          reward: str | None = None, format_reward: float | None = None,
                          **_: Any) -> dict[str, float]:
    """``{"score": the env's reward, em, f1, acc, answered, invalid_actions, turns}``; keyword arguments
    (``reward_kwargs`` in verl's config) override the env settings recorded in ``extra_info``."""
    extra_info = extra_info or {}
    max_turns = int(max_turns if max_turns is not None else extra_info.get("max_turns") or 4)
    reward = reward or extra_info.get("reward") or "auto"
    format_reward = float(format_reward if format_reward is not None else extra_info.get("format_reward") or 0.0)
    prediction, invalid, turns = replay(recorded_turns(solution_str, extra_info), max_turns)
    choices = {c["letter"]: c["text"] for c in _as_list(ground_truth.get("choices"))}
    golden = [str(answer) for answer in _as_list(ground_truth["target"])]
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


def compute_score(data_source: str, solution_str: str, ground_truth: Mapping[str, Any],
                  extra_info: Mapping[str, Any] | None = None, **kwargs: Any) -> float:
    """The env's reward for the response (:func:`compute_score_details`' ``score``), a float as
    ``verl.trainer.main_eval`` averages it."""
    return compute_score_details(data_source, solution_str, ground_truth, extra_info, **kwargs)["score"]
