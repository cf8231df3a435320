"""CSV fields are read as the file's text (issue 30.8): no NA guessing, no number parsing."""

from __future__ import annotations

import pytest

from stppo_envs import DatasetFormatError, load_examples

NA_WORDS = ["None", "NA", "N/A", "null", "nan", "NaN", "#N/A", "n/a"]


def test_headerless_mmlu_csv_keeps_options_that_look_missing(tmp_path):
    rows = [f'"Which is {word}?",{word},other,third,fourth,A' for word in NA_WORDS]
    rows.append('"Which is none of them?",x,y,z,None,D')  # the answer itself is "None"
    path = tmp_path / "anatomy_test.csv"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    examples = load_examples("mmlu_med", str(path))
    assert [e.choices["A"] for e in examples[:-1]] == NA_WORDS
    assert all(len(e.choices) == 4 for e in examples)
    assert examples[-1].answer_letter == "D" and examples[-1].golden_answers == ("None", "D")


def test_csv_with_a_header_keeps_text_as_written(tmp_path):
    path = tmp_path / "generic_test.csv"
    path.write_text("id,question,A,B,C,D,answer\n"
                    "007,How much?,1.50,1.5,N/A,None,A\n"
                    "008,Which?,True,False,null,nan,C\n", encoding="utf-8")
    first, second = load_examples("mmlu_med", str(path))
    assert first.id == "007" and dict(first.choices) == {"A": "1.50", "B": "1.5", "C": "N/A", "D": "None"}
    assert dict(second.choices) == {"A": "True", "B": "False", "C": "null", "D": "nan"}
    assert second.golden_answers == ("null", "C")


def test_qa_csv_answers_that_look_missing_or_numeric_are_kept(tmp_path):
    path = tmp_path / "bamboogle_test.csv"
    path.write_text("Question,Answer\nWhat is the code name?,NA\nWhich agent?,007\nHow tall in m?,1.50\n",
                    encoding="utf-8")
    examples = load_examples("bamboogle", str(path))
    assert [e.golden_answers for e in examples] == [("NA",), ("007",), ("1.50",)]


@pytest.mark.parametrize("content, message", [
    ("Question,Answer\nWho?,\n", "has no answer"),
    ("Question,Answer\n,Paris\n", "has no question field"),
])
def test_empty_required_cells_are_still_errors(tmp_path, content, message):
    path = tmp_path / "bamboogle_test.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DatasetFormatError, match=message):
        load_examples("bamboogle", str(path))


def test_an_empty_answer_option_is_an_error_and_an_empty_spare_column_is_no_option(tmp_path):
    path = tmp_path / "generic_test.csv"
    path.write_text("question,A,B,C,D,E,answer\nPick?,x,y,z,w,,B\n", encoding="utf-8")
    (example,) = load_examples("mmlu_med", str(path))
    assert sorted(example.choices) == ["A", "B", "C", "D"]  # the row has four options, not a fifth one ""
    bad = tmp_path / "bad_test.csv"
    bad.write_text("question,A,B,C,D,answer\nPick?,x,,z,w,B\n", encoding="utf-8")
    with pytest.raises(DatasetFormatError, match="answer 'B', not one of"):
        load_examples("mmlu_med", str(bad))


def test_medmcqa_csv_keeps_na_options_and_names_a_bad_cop(tmp_path):
    path = tmp_path / "medmcqa_dev.csv"
    path.write_text("id,question,opa,opb,opc,opd,cop\nm1,Which?,None,NA,null,x,2\n", encoding="utf-8")
    (example,) = load_examples("medmcqa", str(path), split="dev")
    assert dict(example.choices) == {"A": "None", "B": "NA", "C": "null", "D": "x"}
    assert example.answer_letter == "B" and example.golden_answers == ("NA", "B")
    path.write_text("id,question,opa,opb,opc,opd,cop\nm1,Which?,a,b,c,d,two\n", encoding="utf-8")
    with pytest.raises(DatasetFormatError, match="cop must be 1-4 .*got 'two'"):
        load_examples("medmcqa", str(path), split="dev")


@pytest.mark.parametrize("width", [2, 3, 5])
def test_letter_column_csv_takes_any_number_of_options_from_two(tmp_path, width):
    """The loader accepts a headerless MCQ CSV of >= 2 options; the adapter must not then ask for A-D."""
    letters = "ABCDE"[:width]
    options = ",".join(f"option {letter}" for letter in letters)
    (tmp_path / "true_false_test.csv").write_text(f'"Is it so?",{options},{letters[-1]}\n', encoding="utf-8")
    (tmp_path / "with_header.csv").write_text(f"question,{','.join(letters)},answer\nWhich?,{options},B\n",
                                              encoding="utf-8")
    headerless, = load_examples("mmlu_med", str(tmp_path / "true_false_test.csv"))
    assert dict(headerless.choices) == {letter: f"option {letter}" for letter in letters}
    assert headerless.answer_letter == letters[-1] and headerless.golden_answers == (f"option {letters[-1]}",
                                                                                     letters[-1])
    with_header, = load_examples("mmlu_med", str(tmp_path / "with_header.csv"))
    assert list(with_header.choices) == list(letters) and with_header.answer_letter == "B"


def test_letter_column_csv_with_one_option_is_refused(tmp_path):
    (tmp_path / "one_test.csv").write_text("question,A,answer\nWhich?,only,A\n", encoding="utf-8")
    with pytest.raises(DatasetFormatError, match="unrecognised multiple-choice record"):
        load_examples("mmlu_med", str(tmp_path / "one_test.csv"))


@pytest.mark.parametrize("split", ["bogus", "tset"])
def test_the_demo_set_refuses_a_split_it_cannot_mean(split):
    """The demo set has train and test; dev/validation name its test part too. Another name must not evaluate the
    test split while the results record the name given."""
    with pytest.raises(ValueError, match=rf"^the demo set has no split {split!r}: use train, or test \(also "):
        load_examples("nq", split=split)
    assert load_examples("nq", split="validation") == load_examples("nq", split="test")
    assert load_examples("nq", split="train") != load_examples("nq", split="test")
