"""``SearchEnvironment``: one episode of a ``stppo/*`` search env, in the shape TRL's ``GRPOTrainer`` drives an
environment (``environment_factory``): ``reset`` poses the question, every public method is a tool the model may
call, and ``get_reward`` scores the finished rollout.

Each tool call is one turn of the Gymnasium env (:class:`stppo_envs.SearchQAEnv`), sent through its own ``step``:
``search(query)`` as ``<search> query </search>``, ``answer(answer)`` as ``<answer> answer </answer>``. So a TRL
rollout gets what the env gives the same turns: the env's retriever and ``topk``, its cleaned query, its
``<information>`` block (``Search failed: ...`` inside it when the retriever fails), its turn budget and its score
(EM / F1 / the MCQ letter, with the format reward when set). A turn the env calls invalid (an empty query, nested
tags), a search on the last turn and any call after the episode ended raise ``ValueError``: TRL hands the message
to the model as the tool's error and counts a tool failure.

In TRL a message without a tool call ends the rollout, so the answer must come through the ``answer`` tool; a
rollout that never calls it scores what the env gives an episode that runs out of turns unanswered: 0.
"""

from __future__ import annotations

from typing import Any

from stppo_envs import SearchQAEnv

TOOL_TEMPLATE = (
    "Answer the given question. Reason step by step before each action. If you lack some knowledge, call the "
    "`search` tool with a query: it returns the top searched results between <information> and </information>. "
    "You can search as many times as you want. When you have the answer, call the `answer` tool with it, without "
    "detailed illustrations (for example Beijing). Question: {question}\n"
)
"""The open-question prompt for tool calling: Search-R1's instructions with the tags replaced by the two tools."""

TOOL_MCQ_TEMPLATE = (
    "Answer the given multiple-choice question. Reason step by step before each action. If you lack some "
    "knowledge, call the `search` tool with a query: it returns the top searched results between <information> "
    "and </information>. You can search as many times as you want. When you are ready, call the `answer` tool "
    "with the letter of the correct option (for example B). Question: {question}\nOptions:\n{options}\n"
)
"""The multiple-choice prompt for tool calling (the options as ``A. text`` lines)."""


class SearchEnvironment:
    """One rollout's environment for ``GRPOTrainer(environment_factory=...)``. Build it with
    :func:`~stppo_agent.integrations.trl.factory.search_environment`, whose factory shares one retriever between
    every instance. ``env`` is the Gymnasium env it steps; ``transcript`` its episode so far."""

    def __init__(self, env: SearchQAEnv):
        self.env = env
        self._reward = 0.0
        self._ended_by: str | None = "reset() was never called"

    def reset(self, index: int | None = None, **row: Any) -> str:
        """Start an episode on example ``index`` of the env's dataset (the dataset row's ``index`` column, as
        :func:`~stppo_agent.integrations.trl.factory.training_dataset` writes it; the env's next shuffled example
        without one) and return its prompt, which TRL appends to the row's last user message."""
        options = {"index": int(index)} if index is not None else None
        prompt, _ = self.env.reset(options=options)
        self._reward, self._ended_by = 0.0, None
        return prompt

    def search(self, query: str) -> str:
        """Search the knowledge corpus for passages relevant to a query.

        Args:
            query: What to search for, in a few words.

        Returns:
            The top passages found, between <information> and </information>.
        """
        observation, _ = self._turn("search", query)
        return observation

    def answer(self, answer: str) -> str:
        """Give the final answer to the question. This ends the episode: call it once, when you are sure.

        Args:
            answer: The answer, as short as possible (for a multiple-choice question, the letter of the option).

        Returns:
            A confirmation that the answer was recorded.
        """
        self._turn("answer", answer)
        return "Your answer was recorded; the episode is over."

    def get_reward(self) -> float:
        """The env's score of the episode: its reward for the answer (0 when the episode has no answer)."""
        return self._reward

    @property
    def transcript(self) -> str:
        """The episode as the env's transcript: prompt, each turn's action text and each observation."""
        return "".join(segment.text for segment in self.env.transcript)

    def _turn(self, kind: str, content: str) -> tuple[str, dict]:
        if self._ended_by is not None:
            raise ValueError(f"the episode is over ({self._ended_by}): no more tool calls")
        if not isinstance(content, str):
            raise ValueError(f"{kind} takes a string, got {type(content).__name__}")
        turn = self.env.turn
        observation, reward, terminated, truncated, info = self.env.step(f"<{kind}> {content} </{kind}>")
        if terminated or truncated:
            self._reward = float(reward)
            self._ended_by = "answer() was called" if terminated else f"all {self.env.max_turns} turns were used"
        if truncated and kind == "search":
            raise ValueError(f"turn {turn + 1} of {self.env.max_turns} was the last: the search was not run and "
                             "the episode ended without an answer")
        if info["action_type"] == "invalid":
            raise ValueError(f"invalid {kind}: {info['invalid_reason']}")
        return observation, info
