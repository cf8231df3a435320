"""``stppo_envs.data.schema``: the Example record's refusals and its FlashRAG form."""

from __future__ import annotations

import pytest

from stppo_envs.data.adapters import example_from_record
from stppo_envs.data.schema import DatasetFormatError, Example

# ---------------------------------------------------------------- schema

def test_example_refuses_an_empty_or_blank_question_and_no_answer_naming_the_example():
    with pytest.raises(DatasetFormatError, match=r"^example 'q1' of nq has an empty question$"):
        Example("q1", "", ("a",), "nq")
    with pytest.raises(DatasetFormatError, match="empty question"):
        Example("q1", "  \t", ("a",), "nq")
    with pytest.raises(DatasetFormatError, match=r"^example 'q2' of nq has no golden answer$"):
        Example("q2", "why?", (), "nq")
    assert Example("q3", " x ", ("a",), "nq").question == " x "


def test_example_refuses_an_answer_letter_that_is_not_an_option():
    with pytest.raises(DatasetFormatError,
                       match=r"^example 'm' of medqa: answer 'C' is not one of the options \['A', 'B'\]$"):
        Example("m", "q?", ("x", "C"), "medqa", choices={"B": "y", "A": "x"}, answer_letter="C")
    ok = Example("m", "q?", ("x", "A"), "medqa", choices={"A": "x", "B": "y"}, answer_letter="A")
    assert ok.is_multiple_choice and not Example("o", "q?", ("x",), "nq").is_multiple_choice


def test_to_dict_is_the_flashrag_record_with_plain_containers():
    mcq = Example("m", "q?", ("x", "A"), "medqa", choices={"A": "x", "B": "y"}, answer_letter="A",
                  metadata={"subject": "s"})
    record = mcq.to_dict()
    assert record == {"id": "m", "question": "q?", "golden_answers": ["x", "A"], "benchmark": "medqa",
                      "choices": {"A": "x", "B": "y"}, "answer_letter": "A", "metadata": {"subject": "s"}}
    assert type(record["golden_answers"]) is list and type(record["choices"]) is dict
    assert type(record["metadata"]) is dict
    open_record = Example("o", "q?", ("x",), "nq").to_dict()
    assert open_record["choices"] is None and open_record["answer_letter"] is None and open_record["metadata"] == {}
    # an exported record loads back as the same question (its metadata stays nested under "metadata")
    back = example_from_record(record, "medqa", "fallback", "qa")
    assert (back.id, back.golden_answers, back.choices, back.answer_letter) == ("m", ("x", "A"), mcq.choices, "A")
