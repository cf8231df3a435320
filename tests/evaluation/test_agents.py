"""``stppo_agent.evaluation.agents``: the scripted baselines' actions and the agent
protocol's checks."""

from __future__ import annotations

import pytest

from stppo_agent.evaluation.agent_specs import SCRIPTED_AGENTS
from stppo_agent.evaluation.agents import (
    DEFAULT_MAX_OBSERVATION_TOKENS,
    GoldSearchAgent,
    NoSearchAgent,
    OracleAgent,
    SearchCopyAgent,
    best_overlapping_option,
    by_id,
    gold_answers,
)
from stppo_agent.evaluation.evaluate import EvalSettings, evaluate_benchmark
from stppo_envs import Example, Segment
from tests.support.evaluation import QA, _no_search_factory, view
from tests.support.retrievers import KeywordRetriever

MCQ = Example("m1", "Which lowers glucose?", ("insulin", "B"), "medqa", choices={"A": "aspirin", "B": "insulin"},
              answer_letter="B")


# -- agents.py --------------------------------------------------------------------------------------------------
def test_agents_episode_view_defaults_its_episode_id_to_the_example_and_shows_the_last_segment():
    episode = view(transcript=[Segment("user", "p", -1), Segment("assistant", "a", 0), Segment("environment", "o", 0)])
    assert episode.episode_id == "q1" and episode.max_turns is None and episode.last_observation == "o"
    assert view(episode_id="q1#2").episode_id == "q1#2"


def test_agents_oracle_and_no_search_say_exactly_these_actions():
    assert OracleAgent([QA, MCQ]).act([view(), view(example=MCQ)]) == [
        "<think>I know this.</think>\n<answer> Shakespeare </answer>",
        "<think>I know this.</think>\n<answer> B </answer>"]  # the first golden answer; the letter for MCQ
    assert NoSearchAgent().act([view(), view()]) == ["<think>I will not search.</think>\n<answer> ∅ </answer>"] * 2
    assert gold_answers([QA, MCQ]) == {"q1": "Shakespeare", "m1": "B"}
    assert OracleAgent.name == "oracle" and NoSearchAgent.name == "no-search"


def test_agents_by_id_refuses_a_repeated_id_and_keeps_the_order():
    other = Example("q2", "Capital of Peru?", ("Lima",), "nq")
    assert by_id([other, QA]) == [other, QA]
    with pytest.raises(ValueError, match=r"example id 'q1' occurs more than once; scripted agents look examples up "
                                         r"by id, so each needs its own"):
        by_id([QA, other, QA])


def test_agents_gold_search_searches_the_question_then_each_missing_hop_then_answers():
    agent = GoldSearchAgent([QA])
    assert agent.name == "gold-search"
    assert agent.act([view(turn=0, max_turns=4)]) == [
        "<think>I need to look this up.</think>\n<search> Who wrote Hamlet? </search>"]
    seen_first = [Segment("user", "p", -1), Segment("assistant", "s", 0),
                  Segment("environment", 'Doc 1(Title: "Hamlet") text', 0)]
    assert agent.act([view(turn=1, transcript=seen_first, max_turns=4)]) == [
        "<think>I still need to know about Stratford.</think>\n<search> Stratford </search>"]
    # a title in an assistant segment was not retrieved: only the environment's segments count
    said_not_seen = [Segment("user", 'p (Title: "Hamlet")', -1), Segment("assistant", '(Title: "Stratford")', 0),
                     Segment("environment", "nothing", 0)]
    assert "know about Hamlet" in agent.act([view(turn=1, transcript=said_not_seen, max_turns=4)])[0]
    both = seen_first + [Segment("environment", 'Doc 1(Title: "Stratford") x', 1)]
    answer = "<think>The documents answer it.</think>\n<answer> Shakespeare </answer>"
    assert agent.act([view(turn=2, transcript=both, max_turns=4)]) == [answer]
    # the last turn answers whatever is missing: turn 2 of 3 (max_turns - 1), and turn 0 of a one-turn episode
    assert agent.act([view(turn=2, transcript=seen_first, max_turns=3)]) == [answer]
    assert agent.act([view(turn=1, transcript=seen_first, max_turns=3)])[0].startswith("<think>I still need")
    assert agent.act([view(turn=0, max_turns=1)]) == [answer]
    assert agent.act([view(turn=0, max_turns=2)])[0].endswith("<search> Who wrote Hamlet? </search>")
    assert agent.act([view(turn=5, transcript=seen_first)])[0].startswith("<think>I still need")  # no limit known
    single = Example("s1", "Capital of Peru?", ("Lima",), "nq")  # no supporting titles: one search, then answer
    assert GoldSearchAgent([single]).act([view(turn=1, example=single, transcript=seen_first)]) == [
        "<think>The documents answer it.</think>\n<answer> Lima </answer>"]


def test_agents_search_copy_searches_once_then_copies_the_top_title_or_the_best_option():
    agent = SearchCopyAgent()
    assert agent.name == "search-copy"
    assert agent.act([view()]) == ["<think>Let me look it up.</think>\n<search> Who wrote Hamlet? </search>"]
    docs = 'Doc 1(Title: "Shakespeare") wrote it\nDoc 2(Title: "Marlowe") did not'
    turn1 = [Segment("user", "p", -1), Segment("assistant", "s", 0), Segment("environment", "old", 0),
             Segment("environment", docs, 0)]
    assert agent.act([view(turn=1, transcript=turn1)]) == ["<answer> Shakespeare </answer>"]
    nothing = turn1[:-1] + [Segment("environment", "no documents", 0)]
    assert agent.act([view(turn=1, transcript=nothing)]) == ["<answer> unknown </answer>"]
    mcq = turn1[:-1] + [Segment("environment", "insulin is a hormone", 0)]
    assert agent.act([view(turn=1, transcript=mcq, example=MCQ, choices=MCQ.choices)]) == ["<answer> B </answer>"]


def test_agents_best_overlapping_option_counts_every_occurrence_and_breaks_ties_to_the_first_letter():
    assert best_overlapping_option("Insulin, insulin and aspirin", {"A": "aspirin", "B": "insulin"}) == "B"
    assert best_overlapping_option("aspirin insulin", {"B": "insulin", "A": "aspirin"}) == "A"
    assert best_overlapping_option("nothing here", {"C": "x", "D": "y"}) == "C"
    assert best_overlapping_option("the red car", {"A": "blue car", "B": "red car"}) == "B"


def test_agents_the_scripted_registry_builds_each_baseline():
    assert sorted(SCRIPTED_AGENTS) == ["gold-search", "no-search", "oracle", "search-copy"]
    for name, cls in (("oracle", OracleAgent), ("no-search", NoSearchAgent), ("search-copy", SearchCopyAgent),
                      ("gold-search", GoldSearchAgent)):
        agent = SCRIPTED_AGENTS[name]([QA])
        assert type(agent) is cls and agent.name == name


# An agent that returns another number of actions than episodes is refused.


@pytest.mark.parametrize("extra", [-1, 1])
def test_an_agent_that_returns_another_number_of_actions_than_episodes_is_refused(extra):
    # zip() paired what it could: an extra action went nowhere, a missing one left its episode to be asked again
    # (forever, for an agent that always drops one)
    from stppo_agent.evaluation.agents import NoSearchAgent
    from stppo_agent.evaluation.evaluate import run_episodes
    from stppo_envs import SearchQAEnv

    class OffByOne(NoSearchAgent):
        name = "off-by-one"

        def act(self, episodes):
            return super().act(episodes) + ["<answer> x </answer>"] * extra if extra > 0 else \
                super().act(episodes)[:extra]

    envs = [SearchQAEnv("nq", limit=2) for _ in range(2)]
    with pytest.raises(ValueError, match=f"agent off-by-one returned {2 + extra} actions for 2 episodes"):
        run_episodes(envs, OffByOne(), [0, 1])


@pytest.mark.parametrize("cut", [1, DEFAULT_MAX_OBSERVATION_TOKENS - 1, DEFAULT_MAX_OBSERVATION_TOKENS + 1, 4096])
def test_an_observation_cut_other_than_the_default_is_recorded_below_it_as_above_it(cut):
    settings = EvalSettings("nq", limit=1, retriever=KeywordRetriever(), max_observation_tokens=cut)
    provenance = evaluate_benchmark("no-search", settings, agent_factory=_no_search_factory)["provenance"]
    assert provenance["max_observation_tokens"] == cut
