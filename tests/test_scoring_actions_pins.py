"""Scoring and action parsing pinned by value where only doctests guarded them (survivors of `make mutants`)."""

from __future__ import annotations

import pytest

from stppo_envs.actions import MAX_QUERY_CHARS, ActionType, parse_action
from stppo_envs.scoring import (
    choice_accuracy_batch,
    exact_match,
    exact_match_batch,
    extract_choice,
    f1_score,
    f1_score_batch,
    golden_list,
)

OPTIONS = {"A": "aspirin", "B": "insulin", "C": "warfarin"}


def test_a_bare_string_gold_is_one_answer_not_its_letters():
    assert golden_list("Paris") == ["Paris"] and golden_list(("a", "b")) == ["a", "b"]
    assert f1_score("a", "abc") == 0.0  # as letters, "a" would match the gold "a" perfectly
    assert exact_match("a", "abc") == 0.0 and exact_match("the Paris", "Paris") == 1.0


def test_f1_edge_values():
    assert f1_score(None, ["x"]) == 0.0 and f1_score("x", []) == 0.0
    assert f1_score("Eiffel Tower in Paris", ["the Eiffel Tower", "Paris"]) == pytest.approx(2 / 3)


def test_a_choice_is_named_by_letter_or_by_exactly_one_option_text():
    assert extract_choice("insulin", OPTIONS) == "B"  # by its text
    assert extract_choice("The answer is C", OPTIONS) == "C"
    assert extract_choice("no idea", OPTIONS) is None
    assert extract_choice("insulin", {"A": "insulin", "B": "Insulin."}) is None  # two options match: ambiguous
    assert extract_choice("", OPTIONS) is None and extract_choice(None, OPTIONS) is None


def test_batch_scores_equal_the_single_ones():
    predictions = ["Paris", "the eiffel tower", None, "Rome"]
    golds = [["paris"], ["Eiffel Tower", "tower"], ["x"], "Paris"]
    assert exact_match_batch(predictions, golds) == [exact_match(p, g) for p, g in zip(predictions, golds)]
    assert f1_score_batch(predictions, golds) == [f1_score(p, g) for p, g in zip(predictions, golds)]
    assert choice_accuracy_batch(["B", "aspirin", "nothing"], [OPTIONS] * 3, ["B", "A", "C"]) == [1.0, 1.0, 0.0]


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


def test_batch_scores_refuse_misaligned_lists():
    with pytest.raises(ValueError, match="batch lengths differ: 2 predictions vs 1 references"):
        exact_match_batch(["a", "b"], [["a"]])


def test_losses_and_estimators_register_as_decorators_too():
    from stppo_agent.algorithms import (
        ADVANTAGE_ESTIMATORS,
        POLICY_LOSSES,
        get_advantage_estimator,
        get_policy_loss,
        register_advantage_estimator,
        register_policy_loss,
    )

    for registry, name in ((POLICY_LOSSES, "test_pin_loss"), (ADVANTAGE_ESTIMATORS, "test_pin_adv")):
        registry._items.pop(name, None)

    @register_policy_loss("test_pin_loss")
    def loss(**kwargs):
        return kwargs

    def estimator(**kwargs):
        return kwargs

    assert register_advantage_estimator("test_pin_adv", estimator) is estimator
    assert get_policy_loss("test_pin_loss") is loss and get_advantage_estimator("test_pin_adv") is estimator
