"""Probes of scoring, env and evaluation promises (session 14): each test failed on the code before its fix."""

from __future__ import annotations

import pytest

from stppo_envs.scoring import f1_score


@pytest.mark.parametrize("prediction, golden, f1", [
    ("yes no", ["yes"], 0.0),  # a hedge naming both got 2/3 on every yes/no question (reward=f1 pays for it)
    ("no yes", ["no"], 0.0),
    ("no, they are not", ["no"], 0.0),  # SQuAD F1: 0.4
    ("yes", ["yes there is"], 0.0),  # a bare yes/no is right or wrong, never partly right
    ("Yes.", ["yes"], 1.0),
    ("yes", ["no", "Yes"], 1.0),  # any gold that matches
    ("Eiffel Tower in Paris", ["the Eiffel Tower"], 2 / 3),  # other answers keep SQuAD's token F1
    ("yesterday and today", ["yesterday"], 0.5),  # "yes" as part of a word is no yes/no answer
])
def test_f1_scores_yes_no_answers_all_or_nothing_as_hotpotqa_and_flashrag_do(prediction, golden, f1):
    assert f1_score(prediction, golden) == pytest.approx(f1)


DRUGS = {"A": "aspirin", "B": "insulin", "C": "warfarin", "D": "heparin"}


@pytest.mark.parametrize("prediction, letter", [
    ("$\\boxed{\\text{B}}$", "B"),  # nested LaTeX (R1-style models): the inner wrapper alone was removed -> None
    ("\\boxed{\\textbf{c}}", "C"), ("The answer is $\\boxed{\\text{(D)}}$", "D"),
    ("B (insulin)", "B"), ("(B) (insulin)", "B"), ("B insulin", "B"), ("B – insulin", "B"), ("B—insulin", "B"),
    ("insulin (B)", "B"), ("Insulin [b].", "B"), ("insulin - (B)", "B"),  # a letter with its own option's text
    ("B – because it lowers glucose", "B"), ("Answer – C", "C"),  # an en/em dash delimits like " - "
])
def test_a_letter_with_its_own_text_nested_latex_and_dashes_name_the_option(prediction, letter):
    from stppo_envs.scoring import extract_choice

    assert extract_choice(prediction, DRUGS) == letter


@pytest.mark.parametrize("prediction", [
    "B (warfarin)", "warfarin (B)", "B cells",  # letter and text disagree, or a word that starts with a letter
    "B (insulin) or C (warfarin)", "insulin (B) or warfarin (C)",  # hedges
    "vitamin (A)",
])
def test_a_letter_beside_other_text_still_names_no_option(prediction):
    from stppo_envs.scoring import extract_choice

    assert extract_choice(prediction, DRUGS) is None
