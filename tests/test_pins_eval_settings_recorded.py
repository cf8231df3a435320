"""Pins that every generation setting of an evaluation is recorded in its provenance, reaches what it describes,
and makes a comparison refuse results produced under another value (issue: one-line bugs the suite let through):
an observation cut below the default, the cut handed to the agent builder and through ``evaluate_all``, and
three-way comparisons whose odd one out is in the middle. Scripted agents and an in-memory retriever only."""

from __future__ import annotations

import pytest

from stppo_agent.evaluation import agent_specs
from stppo_agent.evaluation import evaluate as evaluate_module
from stppo_agent.evaluation.agents import DEFAULT_MAX_OBSERVATION_TOKENS, NoSearchAgent
from stppo_agent.evaluation.comparison import ProvenanceMismatchError, compare, provenance_differences
from stppo_agent.evaluation.evaluate import EvalSettings, evaluate_benchmark
from stppo_agent.evaluation.results import evaluate_all

from .conftest import KeywordRetriever


def _no_search_factory(spec, examples, max_new_tokens):
    return NoSearchAgent()


@pytest.mark.parametrize("cut", [1, DEFAULT_MAX_OBSERVATION_TOKENS - 1, DEFAULT_MAX_OBSERVATION_TOKENS + 1, 4096])
def test_an_observation_cut_other_than_the_default_is_recorded_below_it_as_above_it(cut):
    settings = EvalSettings("nq", limit=1, retriever=KeywordRetriever(), max_observation_tokens=cut)
    provenance = evaluate_benchmark("no-search", settings, agent_factory=_no_search_factory)["provenance"]
    assert provenance["max_observation_tokens"] == cut


def test_the_default_observation_cut_is_not_recorded():
    settings = EvalSettings("nq", limit=1, retriever=KeywordRetriever())
    provenance = evaluate_benchmark("no-search", settings, agent_factory=_no_search_factory)["provenance"]
    assert "max_observation_tokens" not in provenance


def test_the_observation_cut_and_token_budget_reach_the_agent_builder(monkeypatch):
    built = []

    def build_agent(spec, examples, max_new_tokens=256, max_observation_tokens=DEFAULT_MAX_OBSERVATION_TOKENS):
        built.append((spec, max_new_tokens, max_observation_tokens))
        return NoSearchAgent()

    monkeypatch.setattr(agent_specs, "build_agent", build_agent)
    settings = EvalSettings("nq", limit=1, retriever=KeywordRetriever(), max_new_tokens=33,
                            max_observation_tokens=77)
    result = evaluate_benchmark("no-search", settings)
    assert built == [("no-search", 33, 77)]
    assert result["provenance"]["max_new_tokens"] == 33 and result["provenance"]["max_observation_tokens"] == 77


def test_evaluate_all_hands_the_observation_cut_and_the_token_budget_to_every_benchmark(monkeypatch):
    calls = []
    monkeypatch.setattr(evaluate_module, "evaluate_benchmark",
                        lambda agent, settings: calls.append(settings) or {"benchmark": settings.benchmark})
    evaluate_all("oracle", ["nq", "hotpotqa"], {}, None, None, "demo", 5, 2, 16, 3, max_new_tokens=33,
                 max_observation_tokens=77)
    assert [(s.benchmark, s.topk, s.max_turns, s.batch_size, s.seed, s.max_new_tokens, s.max_observation_tokens)
            for s in calls] == [("nq", 5, 2, 16, 3, 33, 77), ("hotpotqa", 5, 2, 16, 3, 33, 77)]


def _record(**provenance):
    base = {"agent": "a", "dataset": "d", "retriever": "r", "topk": 3, "retriever_id": "bm25:x", "seed": 0,
            "max_new_tokens": 256}
    return {"benchmark": "nq", "metrics": {"em": 0.5, "n": 2}, "provenance": {**base, **provenance}}


@pytest.mark.parametrize("first_default", [True, False])
def test_compare_refuses_an_observation_cut_recorded_on_one_side_only(first_default):
    default, cut = _record(), _record(max_observation_tokens=256)
    records = [default, cut] if first_default else [cut, default]
    expected = [512, 256] if first_default else [256, 512]  # absent: the default, 512
    assert provenance_differences(records) == {"max_observation_tokens": expected}
    with pytest.raises(ProvenanceMismatchError, match="max_observation_tokens"):
        compare([[r] for r in records], ["A", "B"])


@pytest.mark.parametrize("key, odd", [("seed", 1), ("max_new_tokens", 64), ("topk", 5),
                                      ("retriever_id", "bm25:y"), ("max_observation_tokens", 128)])
def test_a_three_way_comparison_refuses_an_odd_one_out_in_the_middle(key, odd):
    a, b, c = _record(), _record(**{key: odd}), _record()
    assert key in provenance_differences([a, b, c])
    with pytest.raises(ProvenanceMismatchError, match=key):
        compare([[a], [b], [c]], ["A", "B", "C"])
    compare([[a], [_record()], [c]], ["A", "B", "C"])  # all alike: comparable
