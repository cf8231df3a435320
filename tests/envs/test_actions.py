"""``stppo_envs.actions``: parsing one turn's action text with Search-R1's semantics --
edge cases, the reasons an action is invalid, the query length limit, and a hypothesis fuzz of ``env.step``."""

from __future__ import annotations

import gymnasium as gym
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stppo_envs  # noqa: F401  (registers the ids)
from stppo_envs.actions import MAX_QUERY_CHARS, ActionType, parse_action
from tests.support.envs import _env
from tests.support.retrievers import KeywordRetriever


def test_first_complete_block_decides():
    assert parse_action("<search>a</search><answer>b</answer>").type is ActionType.SEARCH
    assert parse_action("<answer>b</answer><search>a</search>").content == "b"
    assert parse_action("<search>open <answer>b</answer>").content == "b"  # the first *complete* block


def test_think_is_free_text_and_content_is_stripped():
    action = parse_action("<think>maybe <search> is needed</think>\n<answer>\n  Paris \n</answer>")
    assert (action.type, action.content) == (ActionType.ANSWER, "Paris")


def test_invalid_cases_have_reasons():
    cases = {
        "": "no complete",
        "plain text": "no complete",
        "<search></search>": "empty <search>",
        "<answer>   </answer>": "empty <answer>",
        "<search>q": "no complete",
        "<search>q</answer>": "no complete",
        "<search>" + "x" * (MAX_QUERY_CHARS + 1) + "</search>": "longer than",
        "<search><search>q</search></search>": "nested",
        "\x00\xff<ans\x01wer>": "no complete",
    }
    for text, reason in cases.items():
        action = parse_action(text)
        assert action.type is ActionType.INVALID and reason in action.reason, text
    assert "must be str" in parse_action(b"<answer>x</answer>").reason


TAGS = st.sampled_from(["<search>", "</search>", "<answer>", "</answer>", "<think>", "</think>", "<", ">", "/"])
ACTIONS = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(TAGS, st.text(max_size=20)), max_size=30).map("".join),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    st.builds(lambda q: f"<search>{q}</search>", st.text(max_size=600)),
)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(ACTIONS, min_size=1, max_size=5), index=st.integers(0, 40))
def test_fuzzed_actions_never_raise(actions, index):
    env = FUZZ_ENV
    env.reset(options={"index": index})
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        assert env.observation_space.contains(obs)
        assert info["action_type"] in {"search", "answer", "invalid"}
        assert isinstance(reward, float) and 0.0 <= reward <= 1.0
        assert not (terminated and truncated)
        if terminated or truncated:
            assert "prediction" in info and "em" in info
            break


FUZZ_ENV = gym.make("stppo/NQ-v0", retriever=KeywordRetriever(), max_turns=4).unwrapped


def test_parsing_matches_search_r1s_regex_on_tricky_inputs():
    import re

    reference = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
    cases = ["<search>a<answer>b</answer>", "<answer>x</search><search>y</search>", "<search><search>q</search>",
             "<answer>1</answer><answer>2</answer>", "</search><search>z</search>", "<search>a</answer></search>",
             "x" * 10 + "<answer>\nmulti\nline\n</answer>", "<search>never closed", "<search>a</search" * 3]
    from stppo_envs.actions import _first_complete_block

    for text in cases:
        match = reference.search(text)
        assert _first_complete_block(text) == (None if match is None else (match.group(1), match.group(2))), text


def test_long_and_adversarial_actions_parse_in_linear_time():
    import time

    from stppo_envs.actions import MAX_ACTION_CHARS

    hostile = "<search>" * (MAX_ACTION_CHARS // 8)  # 64 KB of unclosed tags: seconds with the regex
    started = time.perf_counter()
    assert parse_action(hostile).type is ActionType.INVALID
    assert parse_action(hostile[:-32] + "<answer>x</answer>").content == "x"
    assert time.perf_counter() - started < 1.0  # a regex backtracking over every tag takes seconds
    too_long = "<answer>x</answer>" + " " * MAX_ACTION_CHARS
    parsed = parse_action(too_long)
    assert parsed.type is ActionType.INVALID and "longer than" in parsed.reason


@pytest.mark.parametrize("action, reason", [(42, "action must be str, got int"), (None, "got NoneType"),
                                            ("<search> a </search", "no complete <search>...</search>"),
                                            ("<search> <answer> x </answer> </search>", "nested action tags"),
                                            ("<search>   </search>", "empty <search> block")])
def test_invalid_actions_say_why(action, reason):
    parsed = parse_action(action)
    assert parsed.type is ActionType.INVALID and reason in parsed.reason


def test_the_query_length_limit_is_inclusive():
    assert parse_action(f"<search>{'q' * MAX_QUERY_CHARS}</search>").type is ActionType.SEARCH
    too_long = parse_action(f"<search>{'q' * (MAX_QUERY_CHARS + 1)}</search>")
    assert too_long.type is ActionType.INVALID and f"query longer than {MAX_QUERY_CHARS}" in too_long.reason


def test_an_invalid_action_reports_its_reason_and_a_non_string_action_is_recorded_by_repr():
    from stppo_envs.actions import INVALID_ACTION_MESSAGE

    env = _env()
    env.reset(options={"index": 0})
    observation, reward, terminated, truncated, info = env.step(42)
    assert info["action_type"] == "invalid" and info["invalid_reason"] and info["invalid_actions"] == 1
    assert observation == INVALID_ACTION_MESSAGE
    assert info["segments"] == [("assistant", "42", 0), ("environment", INVALID_ACTION_MESSAGE, 0)]
    assert "error" not in info and "query" not in info
    assert (reward, terminated, truncated) == (0.0, False, False)
    *_, info = env.step("no tags at all")
    assert info["invalid_actions"] == 2 and info["segments"][1] == ("environment", INVALID_ACTION_MESSAGE, 1)


def test_two_blocks_in_one_action_take_the_first_complete_one_lazily():
    parsed = parse_action("<search> one </search> text <search> two </search>")
    assert parsed.type is ActionType.SEARCH and parsed.content == "one"  # not "one </search> ... <search> two"
    parsed = parse_action("<answer> A </answer><answer> B </answer>")
    assert parsed.content == "A"
