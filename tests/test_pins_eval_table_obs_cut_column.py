"""``format_table``'s "obs cut" column: present when any benchmark cut an observation, each row's rate to three
places, and 0.000 for a result recorded before the rate existed."""

from __future__ import annotations

from stppo_agent.evaluation.results import format_table


def _metrics(**extra) -> dict:
    return {"n": 4, "em": 0.5, "f1": 0.625, "answer_rate": 0.75, "invalid_action_rate": 0.125, "mean_turns": 1.5,
            "mean_search_calls": 0.25, **extra}


def test_the_obs_cut_column_shows_each_rate_and_zero_for_an_unrecorded_one():
    results = [{"benchmark": "nq", "metrics": _metrics(observation_cut_rate=0.125)},
               {"benchmark": "old", "metrics": _metrics()}]
    assert format_table(results).splitlines() == [
        "benchmark    n  EM/acc  F1     answer  invalid  turns  searches  obs cut",
        "-----------  -  ------  -----  ------  -------  -----  --------  -------",
        "nq           4  0.500   0.625  0.750   0.125    1.50   0.25      0.125",
        "old          4  0.500   0.625  0.750   0.125    1.50   0.25      0.000",
        "QA avg (EM)     0.500"]
    uncut = [{"benchmark": "nq", "metrics": _metrics(observation_cut_rate=0.0)}]
    assert "obs cut" not in format_table(uncut)
