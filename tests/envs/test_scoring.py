"""``stppo_envs.scoring``: normalisation, exact match, F1 (all or nothing on yes/no golds),
batch scores, and which option letter a free-text multiple-choice answer names."""

from __future__ import annotations

import json

import pytest

from stppo_envs.scoring import (
    choice_accuracy,
    choice_accuracy_batch,
    exact_match,
    exact_match_batch,
    extract_choice,
    f1_score,
    f1_score_batch,
    golden_list,
    normalize_answer,
)

# The review's examples: an option's whole text that starts like "letter + punctuation".
REVIEW = {"A": "Staphylococcus aureus", "B": "D-dimer", "C": "B-cell lymphoma", "D": "C. difficile"}
DRUGS = {"A": "aspirin", "B": "insulin", "C": "warfarin", "D": "a beta blocker"}
BLOOD_GROUPS = {"A": "O", "B": "A", "C": "B", "D": "AB"}  # options whose texts are letters themselves


@pytest.mark.parametrize("prediction, letter", [
    ("C. difficile", "D"), ("c. difficile", "D"), ("B-cell lymphoma", "C"), ("b-cell lymphoma", "C"),
    ("D-dimer", "B"), ("D-Dimer.", "B"), ("The answer is C. difficile", "D"), ("Answer: D-dimer", "B"),
    ("**C. difficile**", "D"),
])
def test_an_options_whole_text_wins_over_a_leading_letter(prediction, letter):
    assert extract_choice(prediction, REVIEW) == letter
    assert choice_accuracy(prediction, REVIEW, letter) == 1.0


@pytest.mark.parametrize("prediction, letter", [
    ("B", "B"), ("b", "B"), ("(b)", "B"), ("b.", "B"), ("b)", "B"), (" c ", "C"), ("[B]", "B"), ("[b]", "B"),
    ("**B**", "B"), ("*B*", "B"), ("__B__", "B"), ("`B`", "B"), ("**(B)**", "B"), ("(B).", "B"), ("{C}", "C"),
    ("B. insulin", "B"), ("b. insulin", "B"), ("(b) insulin", "B"), ("B) insulin", "B"), ("B: insulin", "B"),
    ("B - insulin", "B"), ("**B.** insulin", "B"), ("**B. insulin**", "B"), ("B.\nInsulin lowers glucose.", "B"),
    ("B\n\nInsulin lowers glucose.", "B"), ("Answer - B", "B"),
    ("The answer is b", "B"), ("the answer is (c)", "C"), ("The answer is **C**", "C"), ("Answer: c", "C"),
    ("answer: [B]", "B"), ("The correct option is C.", "C"), ("Choice: b", "B"),
    ("I think the answer is C because warfarin is an anticoagulant", "C"), ("The answer is B.", "B"),
    ("Final answer: **B**", "B"), ("\\boxed{B}", "B"), ("The answer is $\\boxed{b}$", "B"), ("option B", "B"),
    ("Option B is wrong; the answer is C", "C"), ("The answer is B, not option C", "B"),
    ("insulin", "B"), ("Insulin.", "B"), ("**insulin**", "B"),
    ("the answer is insulin", "B"), ("a beta blocker", "D"), ("A beta blocker", "D"), ("beta blocker", "D"),
])
def test_letters_in_either_case_markdown_and_lead_ins(prediction, letter):
    assert extract_choice(prediction, DRUGS) == letter


@pytest.mark.parametrize("prediction, letter", [
    ("a", "A"), ("A", "A"), ("(a)", "A"), ("a.", "A"), ("a) aspirin", "A"), ("a. aspirin", "A"),
    ("The answer is a", "A"), ("The answer is a.", "A"), ("the answer is (a)", "A"), ("**a**", "A"),
])
def test_a_lone_or_delimited_a_is_the_letter(prediction, letter):
    # The prompt asks for a letter; "a" alone or delimited like a letter means nothing else.
    assert extract_choice(prediction, DRUGS) == letter


@pytest.mark.parametrize("prediction", [
    "a blood thinner",  # the article, not option A
    "The answer is a blood thinner",
    "I think so",  # the pronoun, not option I (even when there is one)
    "no idea", "", None, "E", "(e)", "The answer is E",  # no such option
    "A or B", "A, B", "A/B", "A and C", "B or C",  # hedges name no single option
    "B-cell", "e.g. insulin", "x",
])
def test_what_names_no_option(prediction):
    assert extract_choice(prediction, {**DRUGS, "I": "iron"} if prediction == "I think so" else DRUGS) is None


def test_a_bare_letter_is_a_letter_even_when_an_option_text_is_that_letter():
    # The prompt asks for "the letter of the correct option": "B" is option B, not the option whose text is B.
    assert extract_choice("B", BLOOD_GROUPS) == "B" and extract_choice("(b)", BLOOD_GROUPS) == "B"
    assert extract_choice("AB", BLOOD_GROUPS) == "D" and extract_choice("O", BLOOD_GROUPS) == "A"


def test_an_explicit_letter_beats_the_text_after_it():
    assert extract_choice("B. warfarin", DRUGS) == "B"  # the letter is what was asked for


def test_two_options_with_the_same_text_are_ambiguous():
    assert extract_choice("insulin", {"A": "insulin", "B": "Insulin."}) is None
    assert extract_choice("B", {"A": "insulin", "B": "Insulin."}) == "B"


def test_options_that_differ_only_in_punctuation_stay_apart():
    # Real MedMCQA / MMLU options that SQuAD normalisation alone merges.
    rh = {"A": "O group and Rh+ve", "B": "O group and Rh-ve", "C": "AB group and Rh+ve"}
    assert extract_choice("O group and Rh-ve", rh) == "B" and extract_choice("o group and rh+ve.", rh) == "A"
    numbers = {"A": "156", "B": "15.6", "C": "1.56", "D": "15600"}
    assert [extract_choice(p, numbers) for p in ("15.6", "1.56", "156", "The answer is 15.6")] == ["B", "C", "A", "B"]
    angles = {"A": ">50 degree", "B": ">90 degree", "C": "<50 degree", "D": "<90 degree"}
    assert extract_choice(">50 degree", angles) == "A" and extract_choice("> b", angles) == "B"
    assert extract_choice("Mean < Mode", {"A": "Mean = Median", "B": "Mean < Mode", "D": "Mean = Mode"}) == "B"


def test_pubmedqa_words_are_option_texts():
    yes_no = {"A": "yes", "B": "no", "C": "maybe"}
    assert [extract_choice(p, yes_no) for p in ("Yes", "no.", "**maybe**", "The answer is maybe", "b")] == \
        ["A", "B", "C", "C", "B"]


def test_the_env_rewards_an_answer_that_is_an_options_text(tmp_path):
    from stppo_envs import SearchQAEnv

    record = {"id": "q1", "question": "Which organism causes pseudomembranous colitis?", "answer_idx": "D",
              "options": REVIEW}
    path = tmp_path / "medqa_test.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    env = SearchQAEnv("medqa", str(path))
    rewards = {}
    for answer in ("C. difficile", "d", "**D**", "C"):
        env.reset(options={"index": 0})
        _, rewards[answer], terminated, _, info = env.step(f"<answer> {answer} </answer>")
        assert terminated and info["predicted_letter"] == ("C" if answer == "C" else "D")
    assert rewards == {"C. difficile": 1.0, "d": 1.0, "**D**": 1.0, "C": 0.0}


GLUCAGON_OPTIONS = {"A": "glucagon", "B": "insulin", "C": "warfarin"}


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
    assert extract_choice(prediction, GLUCAGON_OPTIONS) == "B"


@pytest.mark.parametrize("prediction", ["insulin (B)", "insulin (b).", "insulin - [B]"])
def test_a_letter_after_its_own_options_text_names_it(prediction):
    assert extract_choice(prediction, GLUCAGON_OPTIONS) == "B"


def test_a_letter_beside_another_options_text_names_nothing():
    assert extract_choice("B (warfarin)", GLUCAGON_OPTIONS) is None
    assert extract_choice("warfarin (B)", GLUCAGON_OPTIONS) is None


def test_a_bare_letter_on_the_first_of_several_lines_names_it():
    assert extract_choice("B\nbecause it lowers glucose\nin the blood", GLUCAGON_OPTIONS) == "B"


def test_a_letter_then_a_word_counts_only_after_an_answer_lead_in():
    assert extract_choice("B because it lowers glucose", GLUCAGON_OPTIONS) is None
    assert extract_choice("The answer is B because it lowers glucose", GLUCAGON_OPTIONS) == "B"
    assert extract_choice("The answer is (B) because it lowers glucose", GLUCAGON_OPTIONS) == "B"


def test_after_a_lead_in_a_lone_a_before_punctuation_is_option_a():
    assert extract_choice("The answer is a, because it raises glucose", GLUCAGON_OPTIONS) == "A"
    assert extract_choice("The answer is a drug that raises glucose", GLUCAGON_OPTIONS) is None  # the article


# Yes/no golds in F1, and option letters beside their own option's text or another's.


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


DRUG_OPTIONS = {"A": "aspirin", "B": "insulin", "C": "warfarin", "D": "heparin"}


@pytest.mark.parametrize("prediction, letter", [
    ("$\\boxed{\\text{B}}$", "B"),  # nested LaTeX (R1-style models): the inner wrapper alone was removed -> None
    ("\\boxed{\\textbf{c}}", "C"), ("The answer is $\\boxed{\\text{(D)}}$", "D"),
    ("B (insulin)", "B"), ("(B) (insulin)", "B"), ("B insulin", "B"), ("B – insulin", "B"), ("B—insulin", "B"),
    ("insulin (B)", "B"), ("Insulin [b].", "B"), ("insulin - (B)", "B"),  # a letter with its own option's text
    ("B – because it lowers glucose", "B"), ("Answer – C", "C"),  # an en/em dash delimits like " - "
])
def test_a_letter_with_its_own_text_nested_latex_and_dashes_name_the_option(prediction, letter):
    from stppo_envs.scoring import extract_choice

    assert extract_choice(prediction, DRUG_OPTIONS) == letter


@pytest.mark.parametrize("prediction", [
    "B (warfarin)", "warfarin (B)", "B cells",  # letter and text disagree, or a word that starts with a letter
    "B (insulin) or C (warfarin)", "insulin (B) or warfarin (C)",  # hedges
    "vitamin (A)",
])
def test_a_letter_beside_other_text_still_names_no_option(prediction):
    from stppo_envs.scoring import extract_choice

    assert extract_choice(prediction, DRUG_OPTIONS) is None


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


def test_batch_scores_refuse_misaligned_lists():
    with pytest.raises(ValueError, match="batch lengths differ: 2 predictions vs 1 references"):
        exact_match_batch(["a", "b"], [["a"]])


# --- scoring and actions --------------------------------------------------------------------------------------

def test_f1_takes_the_best_of_several_golds_and_em_normalises_articles():
    golds = ["the Eiffel Tower", "Paris France", "tower"]
    assert f1_score("Eiffel Tower", golds) == 1.0  # the first gold (articles dropped), not the last
    assert f1_score("Paris", golds) == pytest.approx(2 / 3)
    assert f1_score("tower of pisa", ["pisa leaning", "tower"]) == pytest.approx(0.5)
    assert normalize_answer("The  Beatles!") == "beatles" and normalize_answer("an apple a day") == "apple day"
    assert exact_match("A Beatles", ["the beatles"]) == 1.0 and exact_match("Beatles band", ["Beatles"]) == 0.0
