"""Which option letter a free-text MCQ answer names (issue 30.5): option text before a leading letter,
letters in either case, common markdown; and what stays unreadable."""

from __future__ import annotations

import json

import pytest

from stppo_envs.scoring import choice_accuracy, extract_choice

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
