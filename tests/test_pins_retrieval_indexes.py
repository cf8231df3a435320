"""Pins for the retrieval index slice (issue 27): corpus reading and BM25 building (indexing), pyserini's start-up
(_pyserini), the text encoder (encoder), the dense index build (dense_build) and search (dense). Defaults, boundaries
and which value reaches which call, where tests/test_pins_data_backends.py leaves them open. No JVM, no model: a fake
encoder that records its arguments and gives each passage a fixed vector, fake faiss classes, small tmp files."""

from __future__ import annotations

import codecs
import gzip
import importlib.abc
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from stppo_envs.retrieval import dense_build, indexing
from stppo_envs.retrieval.indexing import CorpusFormatError, iter_contents

PASSAGES = ['"Paris"\nParis is the capital of France', '"Rome"\nRome is a city', 'no title line here',
            '"Nile"\nthe Nile is a river', '"Alps"\nmountains']


def _corpus(tmp_path, passages=PASSAGES):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "contents": c}) + "\n" for i, c in enumerate(passages)))
    return path


class _FakeEncoder:
    """Records how the build made it and what it was asked to embed; passage i (by its text) gets a fixed vector."""

    made: list = []
    calls: list = []

    def __init__(self, settings, device=None, batch_size=64):
        _FakeEncoder.made.append((settings, device, batch_size))

    def encode_passages(self, passages):
        _FakeEncoder.calls.append(list(passages))
        return np.stack([_vector(p) for p in passages]).astype(np.float32)


def _vector(passage: str) -> np.ndarray:
    vector = np.zeros(4, dtype=np.float32)
    vector[PASSAGES.index(passage) % 4] = 1.0 + PASSAGES.index(passage)
    return vector


@pytest.fixture
def fake_encoder(monkeypatch):
    _FakeEncoder.made, _FakeEncoder.calls = [], []
    monkeypatch.setattr(dense_build, "TextEncoder", _FakeEncoder)
    return _FakeEncoder


# ---------------------------------------------------------------- dense_build


def test_dense_build_defaults_reach_the_encoder_the_shards_and_the_progress_bar(tmp_path, fake_encoder, capsys,
                                                                              monkeypatch):
    corpus = _corpus(tmp_path)
    dense_build.build_dense_index(corpus, tmp_path / "idx", str(tmp_path / "enc"))
    ((settings, device, batch_size),) = fake_encoder.made
    assert (settings.model, device, batch_size) == (str(tmp_path / "enc"), None, 64)
    assert fake_encoder.calls == [PASSAGES]  # 5 passages: one shard of the default 4096
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

    out = dense_build.build_dense_index(_corpus(tmp_path), tmp_path / "idx", "enc", shard_size=1, batch_size=1,
                                        progress=False)
    assert fake_encoder.made[0][2] == 1 and fake_encoder.calls == [[p] for p in PASSAGES]
    index = faiss.read_index(str(out / "index.faiss"))
    np.testing.assert_array_equal(np.stack([index.reconstruct(i) for i in range(5)]),
                                  np.stack([_vector(p) for p in PASSAGES]))


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


# ---------------------------------------------------------------- indexing


def test_indexing_reads_and_writes_corpora_as_utf8_whatever_the_locale(tmp_path, monkeypatch):
    opened = []
    real_open, real_gzip_open = open, gzip.open

    def recording_open(file, mode="r", *args, **kwargs):
        opened.append((Path(file).name, mode, kwargs.get("encoding")))
        return real_open(file, mode, *args, **kwargs)

    def recording_gzip_open(file, mode="rb", *args, **kwargs):
        opened.append((Path(file).name, mode, kwargs.get("encoding")))
        return real_gzip_open(file, mode, *args, **kwargs)

    # the locale here is UTF-8 anyway; what is checked is that no read or write depends on it
    monkeypatch.setattr(indexing, "open", recording_open, raising=False)
    monkeypatch.setattr(indexing.gzip, "open", recording_gzip_open)
    plain = tmp_path / "c.jsonl"
    plain.write_text('{"id": "a", "contents": "é"}\n', encoding="utf-8")
    packed = tmp_path / "c.json.gz"
    with real_gzip_open(packed, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps([{"title": "É", "text": "x"}]))
    assert list(iter_contents(plain)) == [("a", "é")] and list(iter_contents(packed)) == [("0", '"É"\nx')]
    out = tmp_path / "out"
    out.mkdir()
    assert indexing.write_jsonl_collection(plain, out) == 1
    assert {name for name, _, _ in opened} == {"c.jsonl", "c.json.gz", "corpus.jsonl"}
    assert all(encoding is not None and codecs.lookup(encoding).name == "utf-8" for _, _, encoding in opened)
    assert [mode for name, mode, _ in opened if name == "corpus.jsonl"] == ["w"]
    assert {mode for name, mode, _ in opened if name == "c.json.gz"} == {"rt"}


def test_a_title_object_corpus_takes_any_value_as_the_passage_text(tmp_path):
    keyed = tmp_path / "k.json"
    keyed.write_text(json.dumps({"T1": 42, "T2": ["a", 1]}, indent=1))
    assert list(iter_contents(keyed)) == [("0", '"T1"\n42'), ("1", '"T2"\na1')]


def test_read_errors_of_gzip_corpora_are_named_and_others_pass_through(tmp_path, monkeypatch):
    def broken(exc):
        def open_text(path):
            raise exc
        return open_text

    packed = tmp_path / "c.jsonl.gz"
    packed.write_bytes(b"")
    monkeypatch.setattr(indexing, "_open_text", broken(EOFError()))
    with pytest.raises(CorpusFormatError, match=r"c.jsonl.gz: not a readable gzip file \(EOFError\)$"):
        list(iter_contents(packed))
    plain = tmp_path / "c.jsonl"
    plain.write_text("{}\n")
    monkeypatch.setattr(indexing, "_open_text", broken(OSError("disk failed")))
    with pytest.raises(OSError, match="^disk failed$") as info:
        list(iter_contents(plain))
    assert not isinstance(info.value, CorpusFormatError)


# ---------------------------------------------------------------- dense


def test_dense_retriever_hands_its_device_and_the_index_settings_to_the_encoder(tmp_path, fake_encoder,
                                                                                monkeypatch):
    from stppo_envs.retrieval import dense

    out = dense_build.build_dense_index(_corpus(tmp_path), tmp_path / "idx", "enc", progress=False)
    made = []
    monkeypatch.setattr(dense, "TextEncoder", lambda settings, device=None: made.append((settings, device)))
    index, docs, _ = dense.DenseRetriever(out, device="cuda:3")._load()
    assert index.ntotal == 5 and len(docs) == 5
    dense.DenseRetriever(out, encoder="other")._load()
    assert [(settings.model, device) for settings, device in made] == [("enc", "cuda:3"), ("other", None)]


def test_dense_index_id_names_the_corpus_hash_the_index_type_and_the_encoder_never_a_path(tmp_path, fake_encoder):
    from stppo_envs.retrieval import dense
    from stppo_envs.retrieval.base import passages_sha256

    out = dense_build.build_dense_index(_corpus(tmp_path, PASSAGES[:3]), tmp_path / "idx", str(tmp_path / "my-enc"),
                                        index_type="hnsw", progress=False)
    digest = passages_sha256([(f"d{i}", c) for i, c in enumerate(PASSAGES[:3])])[:16]
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

    out = dense_build.build_dense_index(_corpus(tmp_path), tmp_path / "idx", "enc", progress=False)
    monkeypatch.setattr(dense, "TextEncoder", lambda settings, device=None: ("encoder", device))
    retriever = dense.DenseRetriever(out, device="cpu", nprobe=5, ef_search=6)
    loaded = retriever._load()
    copy = pickle.loads(pickle.dumps(retriever))  # a faiss index does not pickle: it must not travel
    assert copy._loaded is None and retriever._loaded is loaded
    assert (copy.index_dir, copy.settings, copy.device, copy.nprobe, copy.ef_search) == (out, retriever.settings,
                                                                                         "cpu", 5, 6)
    assert copy._load()[0].ntotal == 5 and copy._load()[2] == ("encoder", "cpu")


def test_a_title_object_corpus_written_on_one_line_is_not_taken_for_json_lines(tmp_path):
    keyed = tmp_path / "hotpot.json"
    keyed.write_text(json.dumps({"T1": ["s1. ", "s2."], "T2": ["x"]}))  # json.dump writes one line
    assert list(iter_contents(keyed)) == [("0", '"T1"\ns1. s2.'), ("1", '"T2"\nx')]
    one_passage = tmp_path / "one.json"  # a JSON-lines file of one passage under a .json name stays one
    one_passage.write_text('{"id": "p", "text": "t", "title": "T"}\n')
    assert list(iter_contents(one_passage)) == [("p", '"T"\nt')]
    # JSON lines under a .json name with misnamed fields stays JSON lines: the error names the passage's fields
    misnamed = tmp_path / "misnamed.json"
    misnamed.write_text('{"id": "a", "body": "x"}\n\n{"id": "b", "body": "y"}\n')
    with pytest.raises(CorpusFormatError, match=r"misnamed.json: passage 0 has neither 'contents' nor 'text' "
                                                r"\(fields: \['body', 'id'\]\)$"):
        list(iter_contents(misnamed))


# ---------------------------------------------------------------- _pyserini (no JVM: fake jnius_config and pyserini)


class _FakePyserini(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of pyserini record the OpenAI key they see (pyserini builds an OpenAI client at import time)."""

    def __init__(self):
        self.imported = []

    def find_spec(self, name, path, target=None):
        if name == "pyserini" or name.startswith("pyserini."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.imported.append((module.__name__, os.environ.get("OPENAI_API_KEY")))


@pytest.fixture
def fake_jvm(monkeypatch, tmp_path):
    from stppo_envs.retrieval import _pyserini

    for name in [n for n in sys.modules if n == "pyserini" or n.startswith("pyserini.")]:
        monkeypatch.delitem(sys.modules, name)
    finder = _FakePyserini()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    options = []
    jnius_config = types.SimpleNamespace(vm_running=False, add_options=lambda *o: options.extend(o))
    monkeypatch.setitem(sys.modules, "jnius_config", jnius_config)
    quieted = []
    monkeypatch.setattr(_pyserini, "_quiet_lucene", lambda: quieted.append(True))
    monkeypatch.setattr(_pyserini, "_choose_java_home", lambda: tmp_path / "jdk")
    monkeypatch.setenv("JAVA_HOME", "/before")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("STPPO_VERBOSE", raising=False)
    return types.SimpleNamespace(start=_pyserini.ensure_pyserini.__wrapped__, module=_pyserini, finder=finder,
                                 options=options, jnius_config=jnius_config, quieted=quieted)


def test_ensure_pyserini_drops_the_vector_module_only_where_the_runtime_lacks_it(fake_jvm, monkeypatch, tmp_path):
    monkeypatch.setattr(fake_jvm.module, "_runtime_has_module", lambda home, module: False)
    monkeypatch.setattr(fake_jvm.module, "_java_major_version", lambda home: 21)
    fake_jvm.start()
    assert os.environ["JAVA_HOME"] == str(tmp_path / "jdk") and fake_jvm.options == []
    fake_jvm.jnius_config.add_options("--add-modules=jdk.incubator.vector", "-Xmx2g")
    assert fake_jvm.options == ["-Xmx2g"]
    assert ("pyserini.search.lucene", "unused-by-stppo") in fake_jvm.finder.imported  # the placeholder at import
    assert "OPENAI_API_KEY" not in os.environ and fake_jvm.quieted == [True]  # ... and gone after it


def test_ensure_pyserini_keeps_a_real_key_and_the_options_of_a_full_runtime(fake_jvm, monkeypatch):
    monkeypatch.setattr(fake_jvm.module, "_runtime_has_module", lambda home, module: module == "jdk.incubator.vector")
    monkeypatch.setattr(fake_jvm.module, "_java_major_version", lambda home: 24)
    monkeypatch.setenv("OPENAI_API_KEY", "the user's")
    monkeypatch.setenv("STPPO_VERBOSE", "1")  # `stppo --verbose` keeps Lucene's INFO lines
    fake_jvm.start()
    assert fake_jvm.options == ["--sun-misc-unsafe-memory-access=allow"]  # Java 24+: no Unsafe warnings
    fake_jvm.jnius_config.add_options("--add-modules=jdk.incubator.vector")
    assert fake_jvm.options[-1] == "--add-modules=jdk.incubator.vector"
    assert ("pyserini.search.lucene", "the user's") in fake_jvm.finder.imported
    assert os.environ["OPENAI_API_KEY"] == "the user's" and fake_jvm.quieted == []


def test_ensure_pyserini_leaves_a_running_jvms_options_alone(fake_jvm, monkeypatch):
    monkeypatch.setattr(fake_jvm.module, "_runtime_has_module", lambda home, module: False)
    monkeypatch.setattr(fake_jvm.module, "_java_major_version", lambda home: 25)
    fake_jvm.jnius_config.vm_running = True
    original = fake_jvm.jnius_config.add_options
    fake_jvm.start()
    assert fake_jvm.jnius_config.add_options is original and fake_jvm.options == []
    monkeypatch.setattr(fake_jvm.module, "_java_major_version", lambda home: 23)
    fake_jvm.jnius_config.vm_running = False
    fake_jvm.start()
    assert fake_jvm.options == []  # Java 23 has no Unsafe warnings to silence
