"""Action parsing edge cases and a hypothesis fuzz of env.step."""

from __future__ import annotations

import gymnasium as gym
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stppo_envs  # noqa: F401  (registers the ids)
from stppo_envs.actions import MAX_QUERY_CHARS, ActionType, parse_action

from .conftest import KeywordRetriever


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
