"""data_scripts/prepare.py on local files (the hub is not reachable here): export, corpus conversion, indexing."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest

from data_scripts.prepare import LOCAL_SOURCES, main
from stppo_envs import load_examples
from stppo_envs.retrieval import make_retriever


def test_datasets_export_round_trips_through_the_loader(shared_data, tmp_path):
    main(["datasets", "--out", str(tmp_path), "--local", str(shared_data),
          "--benchmarks", "bamboogle,musique,medqa,pubmedqa,mmlu_med"])
    for benchmark in ("bamboogle", "musique", "medqa", "pubmedqa", "mmlu_med"):
        relative, split = LOCAL_SOURCES[benchmark]
        direct = load_examples(benchmark, str(shared_data / relative), split)
        exported = load_examples(benchmark, str(tmp_path / benchmark), split)
        assert len(exported) == len(direct) > 0
        for a, b in zip(direct, exported):
            assert (a.id, a.question, a.golden_answers, a.choices, a.answer_letter) == \
                   (b.id, b.question, b.golden_answers, b.choices, b.answer_letter)
        first = json.loads((tmp_path / benchmark / f"{split}.jsonl").read_text().splitlines()[0])
        assert {"id", "question", "golden_answers"} <= set(first)


def test_corpus_conversion_and_indexing(shared_data, tmp_path):
    source = shared_data / "corpus/wiki_dpr_sample_1000.jsonl"
    compressed = tmp_path / "wiki-18.jsonl.gz"
    with open(source, "rb") as src, gzip.open(compressed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    main(["corpus", "wiki18", "--out", str(tmp_path / "corpora"), "--local", str(compressed)])
    converted = (tmp_path / "corpora/wiki18.jsonl").read_text().splitlines()
    original = source.read_text().splitlines()
    assert [json.loads(x) for x in converted] == [{"id": json.loads(y)["id"], "contents": json.loads(y)["contents"]}
                                                  for y in original]
    medrag = tmp_path / "textbooks.jsonl"
    medrag.write_text("".join(json.dumps({"id": f"t{i}", "title": "Anatomy", "content": f"The heart has {i} parts."})
                              + "\n" for i in range(5)))
    main(["corpus", "medical", "--out", str(tmp_path / "corpora"), "--local", str(medrag)])
    first = json.loads((tmp_path / "corpora/medical.jsonl").read_text().splitlines()[0])
    assert first == {"id": "t0", "contents": '"Anatomy"\nThe heart has 0 parts.'}
    main(["index", "--corpus", str(tmp_path / "corpora/medical.jsonl"), "--out", str(tmp_path / "indexes")])
    hits = make_retriever(f"bm25:{tmp_path / 'indexes/bm25'}").search("heart 3 parts", 1)
    assert hits[0].title == "Anatomy" and hits[0].docid == "t3"


def test_a_gzipped_json_list_corpus_is_converted(tmp_path):
    records = [{"id": f"m{i}", "title": f"Title {i}", "text": f"Passage {i}."} for i in range(3)]
    source = tmp_path / "musique.json.gz"
    with gzip.open(source, "wt", encoding="utf-8") as handle:
        json.dump(records, handle, indent=1)  # a JSON list over several lines, as MuSiQue's corpus is
    assert main(["corpus", "wiki18", "--out", str(tmp_path / "out"), "--local", str(source)]) == 0
    converted = [json.loads(x) for x in (tmp_path / "out/wiki18.jsonl").read_text().splitlines()]
    assert converted == [{"id": f"m{i}", "contents": f'"Title {i}"\nPassage {i}.'} for i in range(3)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["wiki18.jsonl"]  # no temporary file


def _gzipped(data: bytes) -> bytes:
    return gzip.compress(data)


MALFORMED = {
    "a JSON list of strings": ("x.json.gz", _gzipped(b'["a", "b"]'), "passage 0 is not a JSON object"),
    "a list on a JSON line": ("x.jsonl", b'{"id": 1, "contents": "a"}\n[1, 2]\n', "line 2: not a JSON object"),
    "a broken JSON line": ("x.jsonl.gz", _gzipped(b'{"id": 1, "contents": "a"}\n{"id": 2, "cont\n'),
                           "line 2: not JSON"),
    "truncated JSON": ("x.json", b'[{"id": 1, "text": "a"}, {"id"', "not JSON"),
    "not UTF-8": ("x.jsonl", b'{"id": 1, "contents": "\xff\xfe"}\n', "not UTF-8"),
    "a truncated gzip file": ("x.jsonl.gz", _gzipped(b'{"id": 1, "contents": "a"}\n' * 500)[:60], "gzip"),
    "not gzip at all": ("x.jsonl.gz", b'{"id": 1, "contents": "a"}\n', "gzip"),
    "no passages": ("x.jsonl", b"\n\n", "no passages"),
    "records without text": ("x.jsonl", b'{"id": 1, "body": "a"}\n', "neither 'contents' nor 'text'"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_local_corpus_is_a_one_line_error_that_leaves_no_file(tmp_path, capsys, case):
    name, data, reason = MALFORMED[case]
    source = tmp_path / "in" / name
    source.parent.mkdir()
    source.write_bytes(data)
    out = tmp_path / "out"
    assert main(["corpus", "wiki18", "--out", str(out), "--local", str(source)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("prepare.py corpus: error: ") and reason in err, err
    assert not out.exists() or list(out.iterdir()) == []  # no temporary file, no empty output


@pytest.mark.parametrize("lines, reason", [(['{"id": "t0", "title": "A"}'], "line 1 has no 'content'"),
                                          (['{"id": "t0", "content": "x"}', "not json"], "line 2: not JSON"),
                                          (["[1]"], "line 1: not a JSON object")])
def test_a_malformed_medrag_corpus_is_a_one_line_error(tmp_path, capsys, lines, reason):
    source = tmp_path / "textbooks.jsonl"
    source.write_text("\n".join(lines) + "\n")
    assert main(["corpus", "medical", "--out", str(tmp_path / "out"), "--local", str(source)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and reason in err, err
    assert list((tmp_path / "out").iterdir()) == [] if (tmp_path / "out").exists() else True
