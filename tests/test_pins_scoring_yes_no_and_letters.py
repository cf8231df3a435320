"""Pins of scoring version 2 (stppo_envs/scoring.py): F1's all-or-nothing yes/no rule and the option-letter rules
added with it (a letter beside its own option's text, in either order), each with the value it must give."""

from __future__ import annotations

import pytest

from stppo_envs.scoring import extract_choice, f1_score

OPTIONS = {"A": "glucagon", "B": "insulin", "C": "warfarin"}


@pytest.mark.parametrize("prediction, gold, expected", [
    ("yes", "yes", 1.0),          # equal: the ordinary F1 of identical answers
    ("Yes.", "yes", 1.0),         # equal after normalisation
    ("yes no", "yes", 0.0),       # the hedge earns nothing (SQuAD's F1 would give 2/3)
    ("yes", "yes it is", 0.0),    # a yes/no prediction against a longer gold: all or nothing
    ("no answer", "noanswer", 0.0),
    ("the tower", "tower paris", 2 / 3),  # no yes/no on either side: token F1 as before
])
def test_f1_scores_a_yes_no_answer_or_gold_all_or_nothing(prediction, gold, expected):
    assert f1_score(prediction, gold) == pytest.approx(expected)


def test_f1_a_yes_no_gold_against_a_longer_prediction_is_zero():
    assert f1_score("yes it is", "yes") == 0.0  # the gold is in the set, the prediction is not


@pytest.mark.parametrize("prediction", ["B (insulin)", "B insulin", "B—insulin", "b (Insulin)", "(B) insulin"])
def test_a_letter_before_its_own_options_text_names_it(prediction):
    assert extract_choice(prediction, OPTIONS) == "B"


@pytest.mark.parametrize("prediction", ["insulin (B)", "insulin (b).", "insulin - [B]"])
def test_a_letter_after_its_own_options_text_names_it(prediction):
    assert extract_choice(prediction, OPTIONS) == "B"


def test_a_letter_beside_another_options_text_names_nothing():
    assert extract_choice("B (warfarin)", OPTIONS) is None
    assert extract_choice("warfarin (B)", OPTIONS) is None


def test_a_bare_letter_on_the_first_of_several_lines_names_it():
    assert extract_choice("B\nbecause it lowers glucose\nin the blood", OPTIONS) == "B"


def test_a_letter_then_a_word_counts_only_after_an_answer_lead_in():
    assert extract_choice("B because it lowers glucose", OPTIONS) is None
    assert extract_choice("The answer is B because it lowers glucose", OPTIONS) == "B"
    assert extract_choice("The answer is (B) because it lowers glucose", OPTIONS) == "B"


def test_after_a_lead_in_a_lone_a_before_punctuation_is_option_a():
    assert extract_choice("The answer is a, because it raises glucose", OPTIONS) == "A"
    assert extract_choice("The answer is a drug that raises glucose", OPTIONS) is None  # the article
