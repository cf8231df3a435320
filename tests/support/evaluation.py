"""Scripted agents, small examples and factories of the evaluation tests."""

from __future__ import annotations

from stppo_agent.evaluation.agents import EpisodeView, NoSearchAgent
from stppo_envs import Example, Segment

QA = Example("q1", "Who wrote Hamlet?", ("Shakespeare", "William Shakespeare"), "nq",
             metadata={"supporting_titles": ["Hamlet", "Stratford"]})


def view(turn=0, transcript=None, example=QA, max_turns=None, episode_id=None, choices=None):
    transcript = transcript or (Segment("user", f"PROMPT {example.question}", -1),)
    return EpisodeView(example.id, example.question, choices, tuple(transcript), turn, max_turns, episode_id)


def _no_search_factory(spec, examples, max_new_tokens):
    return NoSearchAgent()
