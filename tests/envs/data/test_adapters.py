"""``stppo_envs.data.adapters``: which field of each benchmark format is the
question, the answers and the options, and the rows refused."""

from __future__ import annotations

import pytest

from stppo_envs.data.adapters import (
    _as_answer_list,
    _choices_from,
    _present,
    example_from_record,
    mcq_example,
    qa_example,
    record_id,
    supporting_titles,
)
from stppo_envs.data.schema import DatasetFormatError

# ---------------------------------------------------------------- adapters

def test_record_id_takes_the_first_present_id_field_as_text():
    assert record_id({"id": "", "_id": None, "qid": 7, "question_id": "z"}, "fb") == "7"
    assert record_id({"_id": "h", "qid": "q"}, "fb") == "h"
    assert record_id({"id": 0}, "fb") == "0"  # 0 is an id, not a missing one
    assert record_id({"question_id": "z"}, "fb") == "z"
    assert record_id({"other": 1}, "fb") == "fb"


def test_qa_question_fields_in_order_skipping_empty_ones():
    assert qa_example({"question": "", "Question": " Q1? ", "query": "no", "answer": "a"}, "nq", "f").question == "Q1?"
    assert qa_example({"QUESTION": "Q2", "answer": "a"}, "nq", "f").question == "Q2"
    assert qa_example({"query": "Q3", "answer": "a"}, "nq", "f").question == "Q3"
    with pytest.raises(DatasetFormatError, match=r"^nq: a record has no question field \(looked for question, "
                                                 r"Question, QUESTION, query\); its fields are \['answer', 'q'\]$"):
        qa_example({"q": "x", "answer": "a"}, "nq", "f")


def test_qa_answers_from_every_field_in_order_deduplicated_and_blank_free():
    record = {"id": 5, "question": "q", "golden_answers": ["g1", " "], "answer": "a1", "answers": ["g1", "a2"],
              "Answer": "A3", "possible_answers": '["p1", null]', "answer_aliases": ["al"], "other": "x"}
    example = qa_example(record, "nq", "f")
    assert example.golden_answers == ("g1", "a1", "a2", "A3", "p1", "al")
    assert (example.id, example.benchmark, example.choices, example.answer_letter) == ("5", "nq", None, None)
    with pytest.raises(DatasetFormatError, match=r"^nq: record 'f' has no answer \(looked for golden_answers, answer, "
                                                 r"answers, Answer, possible_answers\); its fields are \['answer', "
                                                 r"'question'\]$"):
        qa_example({"question": "q", "answer": ["", "  "]}, "nq", "f")


def test_answer_lists_from_strings_json_strings_mappings_and_lists():
    assert _as_answer_list(None) == []
    assert _as_answer_list(" plain ") == [" plain "]
    assert _as_answer_list(' ["a", null, 3] ') == ["a", "3"]
    assert _as_answer_list("[not json]") == ["[not json]"]
    assert _as_answer_list("[open") == ["[open"]
    assert _as_answer_list("close]") == ["close]"]
    assert _as_answer_list({"value": "v", "aliases": ["x", None], "normalized_aliases": ["n"]}) == ["v", "x"]
    assert _as_answer_list(["a", None, 2]) == ["a", "2"]


def test_metadata_keeps_known_fields_that_are_present_and_the_supporting_titles():
    record = {"question": "q", "answer": "a", "type": "bridge", "level": None, "subject": "", "answerable": False,
              "meta_info": "m", "junk": 1, "supporting_facts": [["T1", 0], ["T2", 1], ["T1", 2]]}
    assert qa_example(record, "hotpotqa", "f").metadata == {
        "type": "bridge", "meta_info": "m", "subject": "", "answerable": False, "supporting_titles": ["T1", "T2"]}
    assert qa_example({"question": "q", "answer": "a"}, "nq", "f").metadata == {}


def test_supporting_titles_of_every_format():
    assert supporting_titles({"supporting_titles": ["X", 2], "supporting_facts": [["Y", 0]]}) == ["X", "2"]
    assert supporting_titles({"supporting_facts": [["A", 0], [], ["B", 1], ["A", 2]]}) == ["A", "B"]
    assert supporting_titles({"metadata": {"supporting_facts": {"title": ["C", "D", "C"], "sent_id": [0, 1, 2]}}}) \
        == ["C", "D"]
    assert supporting_titles({"metadata": "not a mapping"}) == []
    assert supporting_titles({"supporting_facts": {"sent_id": [0]}}) == []  # a FlashRAG record without titles
    # MuSiQue paragraphs without an idx are numbered by position
    assert supporting_titles({"paragraphs": [{"title": "A"}, {"title": "B"}],
                              "question_decomposition": [{"paragraph_support_idx": 1}]}) == ["B"]
    paragraphs = [{"idx": 3, "title": "P3", "is_supporting": True}, {"idx": 1, "title": "P1"},
                  {"title": "P2-by-position", "is_supporting": True}, "junk",
                  {"idx": 7, "title": "", "is_supporting": True}]
    # hop order from the decomposition, not the paragraphs' order
    assert supporting_titles({"paragraphs": paragraphs, "question_decomposition": [
        {"paragraph_support_idx": 1}, {"paragraph_support_idx": 3}, {"paragraph_support_idx": 99}, "junk"]}) \
        == ["P1", "P3"]
    # no usable decomposition: the paragraphs marked supporting, in their order; untitled ones dropped
    assert supporting_titles({"paragraphs": paragraphs, "question_decomposition": None}) == ["P3", "P2-by-position"]
    assert supporting_titles({"paragraphs": [{"title": "Q", "is_supporting": True}]}) == ["Q"]
    assert supporting_titles({"paragraphs": "no list"}) == [] and supporting_titles({}) == []


def test_present_option_cells():
    assert not _present(None) and not _present("") and not _present("  ")
    assert _present("None") and _present(0) and _present("NA")


def test_choices_from_mappings_and_lists():
    assert _choices_from({" a ": "x", "b": 2, "c": None, "d": " "}) == {"A": "x", "B": "2"}
    assert _choices_from(["x", None, "z"]) == {"A": "x", "C": "z"}
    assert list(_choices_from([str(i) for i in range(10)])) == list("ABCDEFGHIJ")
    with pytest.raises(DatasetFormatError, match=r"^11 options; at most 10 \(A-J\) are supported$"):
        _choices_from([str(i) for i in range(11)])


def test_medqa_options_and_answer_idx():
    example = mcq_example({"question": " Q? ", "options": {"A": "a", "B": "b"}, "answer_idx": " b ",
                           "meta_info": "step1"}, "medqa", "f")
    assert (example.question, example.answer_letter, example.golden_answers) == ("Q?", "B", ("b", "B"))
    assert example.choices == {"A": "a", "B": "b"} and example.metadata == {"meta_info": "step1"}
    assert example.id == "f"
    with pytest.raises(DatasetFormatError, match=r"^medqa: record 'f' has answer 'E', not one of \['A', 'B'\]$"):
        mcq_example({"question": "Q", "options": {"A": "a", "B": "b"}, "answer_idx": "E"}, "medqa", "f")


@pytest.mark.parametrize("cop, letter", [(1, "A"), (4, "D"), (2.0, "B"), ("3", "C"), (" 2 ", "B")])
def test_medmcqa_cop_is_one_based(cop, letter):
    record = {"id": "mm", "question": "Q", "opa": "a", "opb": "b", "opc": "c", "opd": "d", "cop": cop}
    example = mcq_example(record, "medmcqa", "f")
    assert example.answer_letter == letter and example.golden_answers == (letter.lower(), letter)
    assert example.benchmark == "medmcqa" and mcq_example({**record, "id": None}, "medmcqa", "f").id == "f"
    assert example.choices == {"A": "a", "B": "b", "C": "c", "D": "d"} and example.id == "mm"


@pytest.mark.parametrize("cop", [0, 5, 2.5, "x", None])
def test_medmcqa_cop_outside_one_to_four_is_refused(cop):
    record = {"question": "Q", "opa": "a", "opb": "b", "opc": "c", "opd": "d", "cop": cop}
    with pytest.raises(DatasetFormatError, match=r"^medmcqa: cop must be 1-4 \(original MedMCQA release\), got "):
        mcq_example(record, "medmcqa", "f")


def test_mcq_records_need_a_question_and_medmcqa_needs_its_answer_column():
    with pytest.raises(DatasetFormatError, match=r"^medqa: a record has no question field \(looked for question"):
        mcq_example({"options": {"A": "a"}, "answer_idx": "A"}, "medqa", "f")
    # MedMCQA's test split has no cop: no answer to score against, so not a question we can use
    with pytest.raises(DatasetFormatError, match="medmcqa: unrecognised multiple-choice record"):
        mcq_example({"question": "Q", "opa": "a", "opb": "b", "opc": "c", "opd": "d"}, "medmcqa", "f")


def test_medmcqa_missing_option_is_dropped_and_the_cop_message_names_the_value():
    record = {"question": "Q", "opa": "a", "opb": "", "opc": "c", "cop": 3}
    assert mcq_example(record, "medmcqa", "f").choices == {"A": "a", "C": "c"}
    with pytest.raises(DatasetFormatError, match=r"got 7\b"):
        mcq_example({**record, "cop": 7}, "medmcqa", "f")


@pytest.mark.parametrize("decision, letter", [("yes", "A"), (" No ", "B"), ("MAYBE", "C")])
def test_pubmedqa_final_decision(decision, letter):
    example = mcq_example({"QUESTION": "Q", "final_decision": decision, "CONTEXTS": ["c1", "c2"]}, "pubmedqa", "f")
    assert example.answer_letter == letter and (example.benchmark, example.id) == ("pubmedqa", "f")
    assert example.choices == {"A": "yes", "B": "no", "C": "maybe"}
    assert example.metadata == {"contexts": ["c1", "c2"]}
    assert "contexts" not in mcq_example({"QUESTION": "Q", "final_decision": "yes"}, "pubmedqa", "f").metadata
    with pytest.raises(DatasetFormatError, match="^pubmedqa: final_decision must be yes/no/maybe, got 'perhaps'$"):
        mcq_example({"QUESTION": "Q", "final_decision": "Perhaps"}, "pubmedqa", "f")


def test_mmlu_rows_take_every_present_letter_column():
    record = {"question": "Q", "A": "a", "B": "b", "C": "c", "D": "d", "E": "e", "F": "", "answer": "e"}
    example = mcq_example(record, "mmlu_med", "f")
    assert example.choices == {"A": "a", "B": "b", "C": "c", "D": "d", "E": "e"}
    assert example.answer_letter == "E" and example.golden_answers == ("e", "E")
    assert (example.benchmark, example.id) == ("mmlu_med", "f")


def test_generic_choices_with_an_index_or_a_letter():
    indexed = mcq_example({"question": "Q", "choices": ["x", "y", "z"], "answer": 2}, "g", "f")
    assert (indexed.answer_letter, indexed.benchmark, indexed.id) == ("C", "g", "f")
    assert mcq_example({"question": "Q", "choices": ["x", "y"], "answer": 0}, "g", "f").answer_letter == "A"
    assert mcq_example({"question": "Q", "choices": ["x", "y"], "answer": "b"}, "g", "f").answer_letter == "B"
    # answer_idx wins over answer
    assert mcq_example({"question": "Q", "choices": ["x", "y"], "answer": 0, "answer_idx": 1}, "g", "f") \
        .answer_letter == "B"
    assert mcq_example({"question": "Q", "choices": ["x", "y"], "answer_idx": "A"}, "g", "f").answer_letter == "A"
    with pytest.raises(DatasetFormatError) as info:
        mcq_example({"question": "Q", "choices": ["x", "y"]}, "g", "f")
    assert str(info.value) == (
        "g: unrecognised multiple-choice record with fields ['choices', 'question']; expected MedQA (options, "
        "answer_idx), MedMCQA (opa..opd, cop), PubMedQA (QUESTION, final_decision), MMLU (question, A, B[, C ...], "
        "answer) or generic (question, choices, answer)")


def test_example_from_record_dispatches_on_the_family():
    record = {"question": "Q", "choices": ["x", "y"], "answer": "A", "golden_answers": ["x"]}
    assert example_from_record(record, "b", "f", "mcq").is_multiple_choice
    with pytest.raises(DatasetFormatError, match="multiple-choice record"):  # its options would be dropped
        example_from_record(record, "b", "f", "qa")
    # an exported record: answer_letter decides, whatever the family
    exported = {"question": "Q", "choices": {"A": "x", "B": "y"}, "answer_letter": "b", "golden_answers": ["y"]}
    back = example_from_record(exported, "b", "f", "qa")
    assert (back.answer_letter, back.id, back.benchmark, back.golden_answers) == ("B", "f", "b", ("y", "B"))
    assert not example_from_record({**exported, "choices": None}, "b", "f", "qa").is_multiple_choice
    with pytest.raises(DatasetFormatError, match="multiple-choice record"):  # options without an answer letter
        example_from_record({**exported, "answer_letter": ""}, "b", "f", "qa")


# An open-QA benchmark refuses a multiple-choice record; an empty choices field still loads.


@pytest.mark.parametrize("benchmark", ["searchqa", "nq"])
@pytest.mark.parametrize("record", [
    {"id": "1", "question": "Which drug lowers glucose?", "choices": ["aspirin", "insulin"], "answer": "B"},
    {"id": "1", "question": "Which drug lowers glucose?", "options": {"A": "aspirin", "B": "insulin"},
     "answer_idx": "B", "answer": "insulin"},
    {"id": "1", "question": "Which drug lowers glucose?", "opa": "aspirin", "opb": "insulin", "cop": 2,
     "answer": "insulin"},
])
def test_a_multiple_choice_record_is_refused_by_an_open_qa_benchmark(tmp_path, benchmark, record):
    # It loaded as open QA: the prompt lost the options and the gold became the letter "B" (or the option's text),
    # so the model was scored against an answer key it was never shown -- silently.
    import json

    from stppo_envs import DatasetFormatError
    from stppo_envs.data.loading import load_examples

    path = tmp_path / f"{benchmark}_test.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(DatasetFormatError, match=r"multiple-choice record .* family='mcq'"):
        load_examples(benchmark, path)
    assert load_examples(benchmark, path, family="mcq")[0].answer_letter == "B"


def test_an_open_qa_record_with_an_empty_choices_field_still_loads(tmp_path):
    import json

    from stppo_envs.data.loading import load_examples

    path = tmp_path / "nq_test.jsonl"
    rows = [{"id": "1", "question": "Capital of France?", "golden_answers": ["Paris"], "choices": []},
            {"id": "2", "question": "Capital of Peru?", "golden_answers": ["Lima"], "choices": None}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    assert [(e.golden_answers, e.choices) for e in load_examples("nq", path)] == [(("Paris",), None), (("Lima",), None)]


def test_the_refusal_names_the_record_by_its_fallback_id_and_says_how_to_load_it():
    with pytest.raises(DatasetFormatError) as info:
        qa_example({"question": "Q", "options": {"A": "x", "B": "y"}, "answer": "B"}, "nq", "nq-test-7")
    assert str(info.value) == (
        "nq: record 'nq-test-7' is a multiple-choice record (it has 'options'), but nq is open QA: load it as a "
        "multiple-choice benchmark (medqa, medmcqa, pubmedqa, mmlu_med) or with family='mcq' (SearchQAEnv, "
        "load_examples)")


def test_a_scalar_option_cell_is_an_option_and_an_empty_one_is_not():
    with pytest.raises(DatasetFormatError, match=r"it has 'opa'"):  # MedMCQA's opa..opd are scalar cells
        qa_example({"question": "Q", "opa": "aspirin", "answer": "x"}, "nq", "f")
    for empty in ("", "  ", None, [], ["", None], {"A": ""}):  # FlashRAG's QA rows may carry an empty choices
        assert qa_example({"question": "Q", "choices": empty, "opa": empty, "answer": "x"}, "nq", "f").golden_answers \
            == ("x",)
