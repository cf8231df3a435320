"""``stppo_envs.data.loading``: benchmark names and splits, local files and folders,
the hub, CSV and JSON layouts, encodings, unique ids and the in-process cache."""

from __future__ import annotations

import codecs
import json
import os

import pytest

from stppo_envs.data import loading
from stppo_envs.data.loading import benchmark_info, load_examples
from stppo_envs.data.schema import DatasetFormatError


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


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


# CSV fields are read as the file's text: no NA guessing, no number parsing.


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


# Example ids are unique within a dataset: agents and records key episodes' state by them.


def _write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_duplicate_ids_are_refused_and_named(tmp_path):
    ids = ["a", "b", "a", "c", "b"]
    records = [{"id": i, "question": f"Q{n}?", "golden_answers": ["x"]} for n, i in enumerate(ids)]
    with pytest.raises(DatasetFormatError, match=r"2 ids occur more than once.*'a' \(rows 0, 2\), 'b' \(rows 1, 4\)"):
        load_examples("nq", _write_jsonl(tmp_path / "nq_test.jsonl", records))


def test_ids_are_compared_as_text_so_1_and_quoted_1_collide(tmp_path):
    folder = tmp_path / "nq"
    folder.mkdir()
    # one file numbers its ids, the other quotes them: both name example "1"
    (folder / "part1_test.csv").write_text("id,question,answer\n1,Q1?,x\n2,Q2?,y\n", encoding="utf-8")
    (folder / "part2_test.csv").write_text('id,question,answer\n"1",Q3?,z\n', encoding="utf-8")
    with pytest.raises(DatasetFormatError, match=r"'1' \(rows 0, 2\)"):
        load_examples("nq", str(folder))
    mixed = _write_jsonl(tmp_path / "medqa_test.jsonl", [
        {"id": 1, "question": "Q1?", "options": {"A": "x", "B": "y"}, "answer_idx": "A"},
        {"id": "1", "question": "Q2?", "options": {"A": "x", "B": "y"}, "answer_idx": "B"}])
    with pytest.raises(DatasetFormatError, match=r"medqa test: 1 id occurs more than once: '1' \(rows 0, 1\)"):
        load_examples("medqa", mixed)


def test_rows_without_ids_get_unique_ones_and_limits_do_not_hide_duplicates(tmp_path):
    path = _write_jsonl(tmp_path / "nq_test.jsonl", [{"question": f"Q{n}?", "golden_answers": ["x"]} for n in range(3)])
    assert [e.id for e in load_examples("nq", path)] == ["nq-test-0", "nq-test-1", "nq-test-2"]
    records = [{"id": i, "question": f"Q{n}?", "golden_answers": ["x"]} for n, i in enumerate(["a", "b", "a"])]
    with pytest.raises(DatasetFormatError, match="'a'"):
        load_examples("nq", _write_jsonl(tmp_path / "dup_test.jsonl", records), limit=2)  # the file is broken


def test_duplicate_keys_of_a_keyed_json_file_are_refused(tmp_path):
    path = tmp_path / "pubmedqa_test.json"
    record = '{"QUESTION": "Q?", "final_decision": "yes"}'
    path.write_text('{\n"123": ' + record + ',\n"123": ' + record.replace("yes", "no") + "\n}", encoding="utf-8")
    with pytest.raises(DatasetFormatError, match="key '123' occurs more than once"):  # json.load keeps the last
        load_examples("pubmedqa", str(path))


# The loader's in-process cache sees every edit of a dataset file, also inside a folder.


def _write(path, answer: str, mtime_ns: int) -> None:
    path.write_text(json.dumps({"id": "q1", "question": "Capital of France?", "golden_answers": [answer]}) + "\n")
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_editing_a_file_of_a_folder_dataset_in_place_is_seen(tmp_path):
    folder = tmp_path / "nq"
    folder.mkdir()
    path = folder / "nq_test.jsonl"
    _write(path, "Paris", 1_700_000_000_000_000_000)
    folder_mtime = folder.stat().st_mtime_ns
    assert load_examples("nq", str(folder))[0].golden_answers == ("Paris",)
    _write(path, "Lyon!", 1_700_000_000_000_000_000)  # same size, same mtime: only the content differs
    _write(path, "Lyon!", 1_700_000_000_000_000_001)  # ... one nanosecond later
    os.utime(folder, ns=(folder_mtime, folder_mtime))  # an in-place edit leaves the folder's mtime alone
    assert load_examples("nq", str(folder))[0].golden_answers == ("Lyon!",)
    _write(path, "Marseille", 1_700_000_000_000_000_001)  # another size, same mtime
    assert load_examples("nq", str(folder))[0].golden_answers == ("Marseille",)


def test_editing_a_single_file_within_the_same_second_is_seen(tmp_path):
    path = tmp_path / "nq_test.jsonl"
    _write(path, "Paris", 1_700_000_000_100_000_000)
    assert load_examples("nq", str(path))[0].golden_answers == ("Paris",)
    _write(path, "Lyon!", 1_700_000_000_200_000_000)
    assert load_examples("nq", str(path))[0].golden_answers == ("Lyon!",)


def test_a_file_added_to_a_folder_is_seen(tmp_path):
    folder = tmp_path / "nq"
    folder.mkdir()
    _write(folder / "a_test.jsonl", "Paris", 1_700_000_000_000_000_000)
    assert len(load_examples("nq", str(folder))) == 1
    folder_mtime = folder.stat().st_mtime_ns
    (folder / "b_test.jsonl").write_text(json.dumps({"id": "q2", "question": "Q?", "golden_answers": ["x"]}) + "\n")
    os.utime(folder, ns=(folder_mtime, folder_mtime))
    assert len(load_examples("nq", str(folder))) == 2


# Files saved with a UTF-8 byte-order mark load like others.


def test_a_csv_saved_with_a_utf8_bom_loads_like_one_without(tmp_path):
    # Excel's "CSV UTF-8" export starts the file with a byte-order mark; the header's first name must not keep it.
    text = 'id,question,golden_answers\nb1,Who wrote Velmaria?,"Jane Doe"\nb2,Where is Ostrand?,inland\n'
    plain, bom = tmp_path / "plain.csv", tmp_path / "bom.csv"
    plain.write_text(text, encoding="utf-8")
    bom.write_bytes(codecs.BOM_UTF8 + text.encode("utf-8"))
    with_bom = load_examples("nq", dataset=bom)
    assert [(e.id, e.question, tuple(e.golden_answers)) for e in with_bom] == \
        [(e.id, e.question, tuple(e.golden_answers)) for e in load_examples("nq", dataset=plain)]
    assert [e.id for e in with_bom] == ["b1", "b2"]


def test_a_keyed_pubmedqa_json_with_a_utf8_bom_loads_like_one_without(tmp_path):
    # the BOM must not hide the "{" that makes it a keyed file: read as records, the PMIDs would become field names
    records = {"123": {"QUESTION": "Does X help?", "final_decision": "yes", "CONTEXTS": ["c"]},
               "456": {"QUESTION": "Does Y help?", "final_decision": "no", "CONTEXTS": ["d"]}}
    path = tmp_path / "ori_pqal.json"
    path.write_bytes(codecs.BOM_UTF8 + json.dumps(records, indent=1).encode("utf-8"))
    assert [(e.id, e.question) for e in load_examples("pubmedqa", dataset=path)] == \
        [("123", "Does X help?"), ("456", "Does Y help?")]


def test_a_null_split_cell_is_no_split(tmp_path):
    rows = [{"id": "q0", "question": "question 0?", "golden_answers": ["a0"], "split": "train"},
            {"id": "q1", "question": "question 1?", "golden_answers": ["a1"], "split": None}]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [e.id for e in load_examples("nq", path, split="train")] == ["q0"]
    with pytest.raises(DatasetFormatError, match=r"split column with values \['train'\] and no row of split 'None'"):
        load_examples("nq", path, split="None")


def test_a_hub_splits_rows_are_chosen_by_load_dataset_not_by_a_split_column(monkeypatch):
    # _load_cached filters by the split column for local files only
    import datasets

    from stppo_envs.data import loading

    def fake_load_dataset(path, config=None, split=None, **kwargs):
        return datasets.Dataset.from_list([{"question": "hub q", "answer": "a", "split": "validation_matched"}])

    monkeypatch.setattr(loading.datasets, "load_dataset", fake_load_dataset)
    assert [e.question for e in load_examples("nq", "org/split-column-probe", split="test")] == ["hub q"]
