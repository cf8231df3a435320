"""``stppo_agent.rollouts.episode_stats``: rates per episode, turn and
attempted search."""

from __future__ import annotations

import pytest

from stppo_agent.rollouts.episode_stats import episode_rates

# -- episode_stats -------------------------------------------------------------------------------------------------

def episode(turns=0, invalid_actions=0, search_calls=0, search_errors=0, answered=False):
    return dict(turns=turns, invalid_actions=invalid_actions, search_calls=search_calls,
                search_errors=search_errors, answered=answered)


def test_episode_stats_rates_are_per_episode_turn_and_attempted_search():
    rates = episode_rates([episode(3, 1, 2, 1, True), episode(5, 2, 0, 3, False), episode(2, 0, 4, 0, 1)])
    assert rates == pytest.approx({"answer_rate": 2 / 3, "invalid_action_rate": 3 / 10,
                                   "search_error_rate": 4 / 10})
    assert episode_rates([]) == {"answer_rate": 0.0, "invalid_action_rate": 0.0, "search_error_rate": 0.0}
    # no turn, no search: the rates are 0, not a division by zero
    assert episode_rates([episode()]) == {"answer_rate": 0.0, "invalid_action_rate": 0.0, "search_error_rate": 0.0}
    one = episode_rates([episode(1, 1, 0, 1, True)])
    assert one == {"answer_rate": 1.0, "invalid_action_rate": 1.0, "search_error_rate": 1.0}


# --- rates by definition -------------------------------------------------------------------------------------

def test_rates_are_per_turn_and_per_search_not_per_episode():
    from stppo_agent.rollouts.episode_stats import episode_rates

    episodes = [{"turns": 4, "invalid_actions": 2, "search_calls": 1, "search_errors": 1, "answered": True},
                {"turns": 1, "invalid_actions": 0, "search_calls": 0, "search_errors": 0, "answered": False}]
    rates = episode_rates(episodes)
    assert rates["invalid_action_rate"] == pytest.approx(2 / 5)  # per turn (per episode would be 0.25)
    assert rates["search_error_rate"] == pytest.approx(1 / 2)  # per attempted search
    assert rates["answer_rate"] == pytest.approx(1 / 2)
