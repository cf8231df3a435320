"""Example ids are unique within a dataset (issue 30.7): agents and records key episodes' state by them."""

from __future__ import annotations

import json

import pytest

from stppo_envs import DatasetFormatError, load_examples


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_duplicate_ids_are_refused_and_named(tmp_path):
    ids = ["a", "b", "a", "c", "b"]
    records = [{"id": i, "question": f"Q{n}?", "golden_answers": ["x"]} for n, i in enumerate(ids)]
    with pytest.raises(DatasetFormatError, match=r"2 ids occur more than once.*'a' \(rows 0, 2\), 'b' \(rows 1, 4\)"):
        load_examples("nq", _jsonl(tmp_path / "nq_test.jsonl", records))


def test_ids_are_compared_as_text_so_1_and_quoted_1_collide(tmp_path):
    folder = tmp_path / "nq"
    folder.mkdir()
    # one file numbers its ids, the other quotes them: both name example "1"
    (folder / "part1_test.csv").write_text("id,question,answer\n1,Q1?,x\n2,Q2?,y\n", encoding="utf-8")
    (folder / "part2_test.csv").write_text('id,question,answer\n"1",Q3?,z\n', encoding="utf-8")
    with pytest.raises(DatasetFormatError, match=r"'1' \(rows 0, 2\)"):
        load_examples("nq", str(folder))
    mixed = _jsonl(tmp_path / "medqa_test.jsonl", [
        {"id": 1, "question": "Q1?", "options": {"A": "x", "B": "y"}, "answer_idx": "A"},
        {"id": "1", "question": "Q2?", "options": {"A": "x", "B": "y"}, "answer_idx": "B"}])
    with pytest.raises(DatasetFormatError, match=r"medqa test: 1 id occurs more than once: '1' \(rows 0, 1\)"):
        load_examples("medqa", mixed)


def test_rows_without_ids_get_unique_ones_and_limits_do_not_hide_duplicates(tmp_path):
    path = _jsonl(tmp_path / "nq_test.jsonl", [{"question": f"Q{n}?", "golden_answers": ["x"]} for n in range(3)])
    assert [e.id for e in load_examples("nq", path)] == ["nq-test-0", "nq-test-1", "nq-test-2"]
    records = [{"id": i, "question": f"Q{n}?", "golden_answers": ["x"]} for n, i in enumerate(["a", "b", "a"])]
    with pytest.raises(DatasetFormatError, match="'a'"):
        load_examples("nq", _jsonl(tmp_path / "dup_test.jsonl", records), limit=2)  # the file is broken


def test_duplicate_keys_of_a_keyed_json_file_are_refused(tmp_path):
    path = tmp_path / "pubmedqa_test.json"
    record = '{"QUESTION": "Q?", "final_decision": "yes"}'
    path.write_text('{\n"123": ' + record + ',\n"123": ' + record.replace("yes", "no") + "\n}", encoding="utf-8")
    with pytest.raises(DatasetFormatError, match="key '123' occurs more than once"):  # json.load keeps the last
        load_examples("pubmedqa", str(path))
