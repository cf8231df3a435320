"""data_scripts/prepare.py on local files (the hub is not reachable here): export, corpus conversion, indexing."""

from __future__ import annotations

import gzip
import json
import shutil

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
