"""Pins of two data-loading changes: an open-QA benchmark refuses a multiple-choice row (stppo_envs/data/adapters.py
qa_example, _holds_options: its message word for word, a scalar MedMCQA ``opa`` cell counts, an empty ``choices``
does not) and a local file's split column selects rows (stppo_envs/data/loading.py _rows_of_split: a null cell is
no split, not the split "none")."""

from __future__ import annotations

import json

import pytest

from stppo_envs import DatasetFormatError
from stppo_envs.data.adapters import qa_example
from stppo_envs.data.loading import load_examples


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


def test_a_null_split_cell_is_no_split(tmp_path):
    rows = [{"id": "q0", "question": "question 0?", "golden_answers": ["a0"], "split": "train"},
            {"id": "q1", "question": "question 1?", "golden_answers": ["a1"], "split": None}]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [e.id for e in load_examples("nq", path, split="train")] == ["q0"]
    with pytest.raises(DatasetFormatError, match=r"split column with values \['train'\] and no row of split 'None'"):
        load_examples("nq", path, split="None")


def test_a_hub_splits_rows_are_chosen_by_load_dataset_not_by_a_split_column(monkeypatch):
    # _load_cached (lru_cache-decorated: mutmut makes no mutants of it) filters by the column for local files only
    import datasets

    from stppo_envs.data import loading

    def fake_load_dataset(path, config=None, split=None, **kwargs):
        return datasets.Dataset.from_list([{"question": "hub q", "answer": "a", "split": "validation_matched"}])

    monkeypatch.setattr(loading.datasets, "load_dataset", fake_load_dataset)
    assert [e.question for e in load_examples("nq", "org/split-column-probe", split="test")] == ["hub q"]
