"""``summarize``'s observation cut rate divides by the observations the agent read (every turn's but the last),
floored at one only so that no turn read is no division by zero: one observation read and cut is a rate of 1."""

from __future__ import annotations

from stppo_agent.evaluation.evaluate import summarize


def _record(turns: int, cut: int) -> dict:
    return {"em": 0.0, "f1": 0.0, "terminated": True, "truncated": False, "invalid_actions": 0, "search_calls": 0,
            "search_errors": 0, "turns": turns, "response_chars": 0, "observations_cut": cut}


def test_one_observation_read_and_cut_is_a_cut_rate_of_one():
    assert summarize([_record(2, 1)], multiple_choice=False)["observation_cut_rate"] == 1.0
    assert summarize([_record(1, 0)], multiple_choice=False)["observation_cut_rate"] == 0.0
