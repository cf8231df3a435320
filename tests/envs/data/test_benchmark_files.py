"""Every real benchmark format in the fixture pack loads with the right counts and fields."""

from __future__ import annotations

import csv
import json

import pytest

from stppo_envs import DatasetFormatError, load_examples
from stppo_envs.data.loading import BENCHMARKS, benchmark_info


def read_jsonl(path):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def test_nq_open_raw_format(shared_data):
    raw = read_jsonl(shared_data / "qa/nq_open_dev.jsonl")
    examples = load_examples("nq", shared_data / "qa/nq_open_dev.jsonl")
    assert len(examples) == len(raw) == 3610
    for i in (0, 1234, len(raw) - 1):
        assert examples[i].question == raw[i]["question"].strip()
        assert list(examples[i].golden_answers) == list(dict.fromkeys(raw[i]["answer"]))
        assert examples[i].benchmark == "nq" and examples[i].choices is None


def test_flashrag_schema_keeps_ids(shared_data):
    raw = read_jsonl(shared_data / "qa/flashrag_nq_sample_16.jsonl")
    examples = load_examples("nq", shared_data / "qa/flashrag_nq_sample_16.jsonl")
    assert [e.id for e in examples] == [r["id"] for r in raw]
    assert [list(e.golden_answers) for e in examples] == [r["golden_answers"] for r in raw]


def test_hotpotqa_dev_and_distractor(shared_data):
    dev = json.loads((shared_data / "qa/hotpotqa_dev.json").read_text())
    examples = load_examples("hotpotqa", shared_data / "qa/hotpotqa_dev.json")
    assert len(examples) == len(dev) == 7405
    assert examples[1].golden_answers == (dev[1]["answer"],) and examples[1].metadata["type"] == dev[1]["type"]
    distractor = json.loads((shared_data / "qa/hotpotqa_distractor_100.json").read_text())
    examples = load_examples("hotpotqa", shared_data / "qa/hotpotqa_distractor_100.json")
    assert [e.id for e in examples] == [r["_id"] for r in distractor]
    assert examples[5].metadata["level"] == distractor[5]["level"]


def test_musique_uses_aliases(shared_data):
    raw = json.loads((shared_data / "qa/musique_100.json").read_text())
    examples = load_examples("musique", shared_data / "qa/musique_100.json")
    assert len(examples) == 100 and examples[0].id == raw[0]["id"]
    for example, record in zip(examples, raw):
        assert example.golden_answers[0] == record["answer"]
        assert set(record["answer_aliases"]) <= set(example.golden_answers)


def test_bamboogle_csv(shared_data):
    with open(shared_data / "qa/bamboogle_test.csv", encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    examples = load_examples("bamboogle", shared_data / "qa/bamboogle_test.csv")
    assert len(examples) == len(rows) == 125
    assert examples[-1].question == rows[-1]["Question"] and examples[-1].golden_answers == (rows[-1]["Answer"],)


def test_medqa(shared_data):
    raw = read_jsonl(shared_data / "medical/medqa_us_4opt_test.jsonl")
    examples = load_examples("medqa", shared_data / "medical/medqa_us_4opt_test.jsonl")
    assert len(examples) == len(raw) == 1273
    for example, record in zip(examples[:50], raw[:50]):
        assert dict(example.choices) == record["options"]
        assert example.answer_letter == record["answer_idx"]
        assert example.golden_answers[0] == record["answer"]


def test_medmcqa_cop_is_one_based(shared_data):
    raw = read_jsonl(shared_data / "medical/medmcqa_dev.jsonl")
    examples = load_examples("medmcqa", shared_data / "medical/medmcqa_dev.jsonl")
    assert len(examples) == len(raw) == 4183
    for example, record in zip(examples[:100], raw[:100]):
        assert example.id == record["id"]
        assert example.answer_letter == "ABCD"[record["cop"] - 1]
        assert example.choices["C"] == record["opc"]
        assert example.metadata["subject_name"] == record["subject_name"]


def test_pubmedqa_keyed_object(shared_data):
    raw = json.loads((shared_data / "medical/pubmedqa_test.json").read_text())
    examples = load_examples("pubmedqa", shared_data / "medical/pubmedqa_test.json")
    assert len(examples) == len(raw) == 500
    assert [e.id for e in examples] == list(raw)
    for example in examples[:50]:
        record = raw[example.id]
        assert example.question == record["QUESTION"]
        assert example.choices[example.answer_letter] == record["final_decision"]
        assert example.metadata["contexts"] == record["CONTEXTS"]


def test_mmlu_medical_headerless_csv_folder(shared_data):
    folder = shared_data / "medical/mmlu_med"
    rows = []
    for path in sorted(folder.glob("*_test.csv")):
        with open(path, encoding="utf-8", newline="") as handle:
            rows += list(csv.reader(handle))
    examples = load_examples("mmlu_med", folder)
    assert len(examples) == len(rows) == 1089
    for example, row in zip(examples[:40], rows[:40]):
        assert example.question == row[0].strip() and dict(example.choices) == dict(zip("ABCD", row[1:5]))
        assert example.answer_letter == row[5]


def test_limit_and_seeded_shuffle(shared_data):
    path = shared_data / "qa/nq_open_dev.jsonl"
    full = load_examples("nq", path)
    assert load_examples("nq", path, limit=5) == full[:5]
    shuffled = load_examples("nq", path, limit=20, shuffle_seed=3)
    assert shuffled == load_examples("nq", path, limit=20, shuffle_seed=3)
    assert shuffled != full[:20]
    by_id = {e.id: e for e in full}
    assert all(by_id[e.id] == e for e in shuffled)


def test_demo_set_has_three_families_and_splits():
    assert len(load_examples("nq", split="train")) > len(load_examples("nq")) > 50
    assert all(e.is_multiple_choice for e in load_examples("medqa"))
    assert load_examples("hotpotqa")[0].benchmark == "demo-multihop"


def test_unknown_benchmark_and_missing_fields(tmp_path):
    with pytest.raises(KeyError, match=r"unknown benchmark 'nqq' \(did you mean nq\?\); known: 2wiki"):
        benchmark_info("nqq")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q?", "label": "x"}) + "\n")
    with pytest.raises(DatasetFormatError, match="no answer .*fields are \\['label', 'question'\\]"):
        load_examples("nq", bad)
    bad_mcq = tmp_path / "bad_mcq.jsonl"
    bad_mcq.write_text(json.dumps({"question": "q?", "options": {"A": "x"}, "answer_idx": "C"}) + "\n")
    with pytest.raises(DatasetFormatError, match="answer 'C', not one of \\['A'\\]"):
        load_examples("medqa", bad_mcq)
    with pytest.raises(FileNotFoundError, match="neither a local file"):
        load_examples("nq", "missing_file.jsonl")


def test_parquet_and_aliases(tmp_path):
    import datasets

    path = tmp_path / "nq.parquet"
    datasets.Dataset.from_list([{"id": "a", "question": "who?", "golden_answers": ["me"]}]).to_parquet(path)
    assert load_examples("NQ", path)[0].golden_answers == ("me",)
    assert benchmark_info("2WikiMultihopQA").name == "2wiki" and "mmlu_med" in BENCHMARKS


def test_triviaqa_popqa_and_generic_mcq_raw_formats(tmp_path):
    """Formats without a slice in the fixture pack, built from their documented shapes."""
    trivia = tmp_path / "triviaqa.jsonl"
    trivia.write_text(json.dumps({"question_id": "tq1", "question": "Which river?",
                                  "answer": {"value": "Thames", "aliases": ["River Thames", "Thames"]}}) + "\n")
    example = load_examples("triviaqa", trivia)[0]
    assert example.id == "tq1" and example.golden_answers == ("Thames", "River Thames")
    popqa = tmp_path / "popqa.jsonl"
    popqa.write_text(json.dumps({"id": 7, "question": "Who?", "possible_answers": '["Ann", "Anne"]'}) + "\n")
    assert load_examples("popqa", popqa)[0].golden_answers == ("Ann", "Anne")
    generic = tmp_path / "mcq.jsonl"
    generic.write_text(json.dumps({"question": "Pick", "choices": ["x", "y", "z"], "answer": 2}) + "\n")
    example = load_examples("medqa", generic)[0]
    assert (example.answer_letter, example.golden_answers) == ("C", ("z", "C"))


def test_missing_entries_of_answer_and_option_lists_are_not_the_text_none(tmp_path):
    path = tmp_path / "nq_test.jsonl"
    path.write_text(json.dumps({"question": "Where?", "golden_answers": ["Paris", None]}) + "\n")
    assert load_examples("nq", str(path))[0].golden_answers == ("Paris",)
    mcq = tmp_path / "generic_test.jsonl"
    mcq.write_text(json.dumps({"question": "Pick", "choices": ["x", None, "None"], "answer": 2}) + "\n")
    assert dict(load_examples("medqa", str(mcq))[0].choices) == {"A": "x", "C": "None"}


def test_a_split_column_in_a_users_file_selects_that_splits_rows(tmp_path):
    # one file holding every split (as the demo set does): a test evaluation must not see the train questions
    rows = [{"id": f"q{i}", "question": f"question {i}?", "golden_answers": [f"a{i}"], "split": split}
            for i, split in enumerate(["train", "test", "Train", "test", "train"])]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [e.id for e in load_examples("nq", path, split="test")] == ["q1", "q3"]
    assert [e.id for e in load_examples("nq", path, split="TRAIN")] == ["q0", "q2", "q4"]  # names match in any case
    folder = tmp_path / "folder"  # a folder whose files name no split: the column decides there too
    folder.mkdir()
    (folder / "part.jsonl").write_text(path.read_text())
    assert [e.id for e in load_examples("nq", folder, split="test")] == ["q1", "q3"]
    with pytest.raises(DatasetFormatError, match=r"split column.* \['test', 'train'\].* no row of split 'dev'"):
        load_examples("nq", path, split="dev")
