"""``stppo_envs.retrieval.dense``: search by inner product, settings reaching faiss
and the encoder, the index check and id, pickling."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from stppo_envs.retrieval import IndexNotFoundError, RetrievalError, dense, dense_build
from stppo_envs.retrieval.base import Hit
from stppo_envs.retrieval.encoder import EncoderSettings
from tests.support.retrieval_backends import INDEX_PASSAGES, PASSAGES, _corpus, _index_corpus, _reference


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


# ---------------------------------------------------------------- dense


def test_dense_retriever_hands_its_device_and_the_index_settings_to_the_encoder(tmp_path, fake_encoder,
                                                                                monkeypatch):
    from stppo_envs.retrieval import dense

    out = dense_build.build_dense_index(_index_corpus(tmp_path), tmp_path / "idx", "enc", progress=False)
    made = []
    monkeypatch.setattr(dense, "TextEncoder", lambda settings, device=None: made.append((settings, device)))
    index, docs, _ = dense.DenseRetriever(out, device="cuda:3")._load()
    assert index.ntotal == 5 and len(docs) == 5
    dense.DenseRetriever(out, encoder="other")._load()
    assert [(settings.model, device) for settings, device in made] == [("enc", "cuda:3"), ("other", None)]


def test_dense_index_id_names_the_corpus_hash_the_index_type_and_the_encoder_never_a_path(tmp_path, fake_encoder):
    from stppo_envs.retrieval import dense
    from stppo_envs.retrieval.base import passages_sha256

    out = dense_build.build_dense_index(_index_corpus(tmp_path, INDEX_PASSAGES[:3]), tmp_path / "idx",
                                        str(tmp_path / "my-enc"), index_type="hnsw", progress=False)
    digest = passages_sha256([(f"d{i}", c) for i, c in enumerate(INDEX_PASSAGES[:3])])[:16]
    assert dense.DenseRetriever(out).index_id == f"dense:hnsw:corpus-sha256:{digest}:encoder:my-enc"
    assert dense.DenseRetriever(out, encoder="org/enc").index_id.endswith(":encoder:org/enc")
    meta = json.loads((out / "meta.json").read_text())
    del meta["corpus_sha256"], meta["passage_text"]  # as an old index records it
    (out / "meta.json").write_text(json.dumps(meta))
    assert dense.DenseRetriever(out).index_id == "dense:hnsw:3-passages:encoder:my-enc:unquoted-titles"


def test_a_loaded_dense_retriever_pickles_by_its_arguments_and_reloads_in_the_copy(tmp_path, fake_encoder,
                                                                                   monkeypatch):
    import pickle

    from stppo_envs.retrieval import dense

    out = dense_build.build_dense_index(_index_corpus(tmp_path), tmp_path / "idx", "enc", progress=False)
    monkeypatch.setattr(dense, "TextEncoder", lambda settings, device=None: ("encoder", device))
    retriever = dense.DenseRetriever(out, device="cpu", nprobe=5, ef_search=6)
    loaded = retriever._load()
    copy = pickle.loads(pickle.dumps(retriever))  # a faiss index does not pickle: it must not travel
    assert copy._loaded is None and retriever._loaded is loaded
    assert (copy.index_dir, copy.settings, copy.device, copy.nprobe, copy.ef_search) == (out, retriever.settings,
                                                                                         "cpu", 5, 6)
    assert copy._load()[0].ntotal == 5 and copy._load()[2] == ("encoder", "cpu")
