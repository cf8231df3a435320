"""Pins of stppo_agent/cli/evaluate.py's warn_of_cut_observations (the stderr warning where an hf: agent's
observations were cut) word for word, with its boundary (a rate of 0 says nothing) and its default limit."""

from __future__ import annotations

from stppo_agent.cli.evaluate import warn_of_cut_observations
from stppo_agent.evaluation.agents import DEFAULT_MAX_OBSERVATION_TOKENS


def test_the_warning_word_for_word(capsys):
    warn_of_cut_observations([
        {"benchmark": "nq", "metrics": {"observation_cut_rate": 0.125}, "provenance": {}},
        {"benchmark": "popqa", "metrics": {"observation_cut_rate": 1.0}, "provenance": {"max_observation_tokens": 9}},
    ])
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (
        f"stppo eval: warning: observations were cut (nq 12.5% at {DEFAULT_MAX_OBSERVATION_TOKENS} tokens, popqa "
        "100.0% at 9 tokens; share of those the agent read), as in training (max_observation_tokens): the agent did "
        "not see every passage --topk asked for; --max-observation-tokens raises the limit.\n")


def test_a_zero_or_missing_cut_rate_says_nothing(capsys):
    warn_of_cut_observations([{"benchmark": "nq", "metrics": {"observation_cut_rate": 0.0}, "provenance": {}},
                              {"benchmark": "toy", "metrics": {}, "provenance": {}}])
    assert capsys.readouterr().err == ""


def test_the_smallest_cut_is_reported(capsys):
    warn_of_cut_observations([{"benchmark": "nq", "metrics": {"observation_cut_rate": 1e-4},
                               "provenance": {"max_observation_tokens": 512}}])
    assert "(nq 0.0% at 512 tokens;" in capsys.readouterr().err
