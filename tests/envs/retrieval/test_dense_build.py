"""``stppo_envs.retrieval.dense_build``: the faiss index types, a dense
index folder and its resume from finished shards, the refusals before anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stppo_envs.retrieval import dense_build
from stppo_envs.retrieval.base import passages_sha256
from stppo_envs.retrieval.encoder import TextEncoder
from stppo_envs.retrieval.indexing import CorpusFormatError
from tests.support.retrieval_backends import INDEX_PASSAGES, PASSAGES, _corpus, _index_corpus, _reference, _vector


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


# ---------------------------------------------------------------- dense_build


def test_dense_build_defaults_reach_the_encoder_the_shards_and_the_progress_bar(tmp_path, fake_encoder, capsys,
                                                                              monkeypatch):
    corpus = _index_corpus(tmp_path)
    dense_build.build_dense_index(corpus, tmp_path / "idx", str(tmp_path / "enc"))
    ((settings, device, batch_size),) = fake_encoder.made
    assert (settings.model, device, batch_size) == (str(tmp_path / "enc"), None, 64)
    assert fake_encoder.calls == [INDEX_PASSAGES]  # 5 passages: one shard of the default 4096
    err = capsys.readouterr().err  # progress is on by default, counted in passages
    assert "encoding passages: 100%" in err and "5/5 [" in err and "passage/s]" in err

    def interrupt(self, passages):
        raise KeyboardInterrupt

    monkeypatch.setattr(fake_encoder, "encode_passages", interrupt)
    with pytest.raises(KeyboardInterrupt):
        dense_build.build_dense_index(corpus, tmp_path / "idx2", str(tmp_path / "enc"), device="cpu", batch_size=3)
    assert fake_encoder.made[-1][1:] == ("cpu", 3)
    text = (tmp_path / "idx2" / "shards" / "build.json").read_text()
    record = json.loads(text)
    assert record["shard_size"] == 4096 and record["passages"] == 5
    assert text == json.dumps(record, indent=2) + "\n"  # both records are written for people to read
    meta = (tmp_path / "idx" / "meta.json").read_text()
    assert meta == json.dumps(json.loads(meta), indent=2) + "\n"


def test_dense_build_accepts_shards_and_batches_of_one(tmp_path, fake_encoder):
    import faiss

    out = dense_build.build_dense_index(_index_corpus(tmp_path), tmp_path / "idx", "enc", shard_size=1, batch_size=1,
                                        progress=False)
    assert fake_encoder.made[0][2] == 1 and fake_encoder.calls == [[p] for p in INDEX_PASSAGES]
    index = faiss.read_index(str(out / "index.faiss"))
    np.testing.assert_array_equal(np.stack([index.reconstruct(i) for i in range(5)]),
                                  np.stack([_vector(p) for p in INDEX_PASSAGES]))


def test_dense_build_refuses_an_empty_corpus_naming_it(tmp_path, fake_encoder):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(CorpusFormatError, match=r"^.*empty.jsonl: no passages$"):
        dense_build.build_dense_index(empty, tmp_path / "idx", "enc", progress=False)
    assert not (tmp_path / "idx").exists() and fake_encoder.made == []


def test_make_faiss_index_caps_ivf_lists_at_4096(monkeypatch):
    import faiss

    made = []

    class FakeIVF:
        def __init__(self, quantizer, dim, lists, metric):
            made.append((type(quantizer).__name__, dim, lists, metric))

        def train(self, vectors):
            pass

        def add(self, vectors):
            pass

    monkeypatch.setattr(faiss, "IndexIVFFlat", FakeIVF)
    many = np.zeros((1_050_626, 1), dtype=np.float32)  # 4 * sqrt(n) = 4100: more than the cap
    dense_build.make_faiss_index("ivf", 1, many)
    assert made == [("IndexFlatIP", 1, 4096, faiss.METRIC_INNER_PRODUCT)]
    dense_build.make_faiss_index("ivf", 1, many[:1_048_575])  # 4 * sqrt(n) just under 4096: int() rounds down
    assert made[-1][2] == 4095
