"""Fake Lucene searchers, encoders and small corpora of the retrieval-backend
tests: no JVM, no model."""

from __future__ import annotations

import json
import types

import numpy as np

# ---------------------------------------------------------------- BM25 over fake pyserini objects

def _lucene_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "segments_1").write_text("x")
    return path


class _Doc:
    def __init__(self, raw):
        self._raw = raw

    def get(self, name):
        assert name == "raw"
        return self._raw

    def raw(self):
        return self._raw


class _FakeSearcher:
    """pyserini's LuceneSearcher surface: search, batch_search (keyed by qid), doc."""

    def __init__(self, stored=True, fail=None):
        self.calls, self.stored, self.fail = [], stored, fail

    def _results(self, query, k):
        return [types.SimpleNamespace(docid=f"{query}-{i}", score=10 - i,
                                      lucene_document=_Doc(json.dumps({"contents": f'"T{i}"\n{query} {i}'}))
                                      if self.stored else None) for i in range(k)]

    def search(self, query, k=10):
        self.calls.append(("search", query, k))
        if self.fail:
            raise self.fail
        return self._results(query, k)

    def batch_search(self, queries, qids, k=10, threads=1):
        self.calls.append(("batch_search", queries, qids, k, threads))
        return {qid: self._results(query, k) for qid, query in reversed(list(zip(qids, queries)))}

    def doc(self, docid):
        return _Doc(json.dumps({"contents": f"plain {docid}"})) if not docid.startswith("gone") else None


# ---------------------------------------------------------------- dense: encoder settings, tiny BERT, faiss


WORDS = ("paris capital france rome italy nile river africa danube europe everest mountain highest city of the is "
         "a and in title query passage").split()
PASSAGES = ['"Paris"\nParis is the capital of France', 'Rome\nRome is a city of Italy',
            'the Nile is a river in Africa', '"Danube"\nthe Danube river in Europe',
            '"Everest"\nEverest is the highest mountain', '"France"\nFrance', '"Italy"\nItaly and Rome and Paris']


def _reference(tiny_bert, texts, pooling="mean", normalize=True, max_length=256):
    """One text at a time, no padding: what each vector must be whatever the batching."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(tiny_bert), AutoModel.from_pretrained(tiny_bert).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            hidden = model(**tokenizer([text], truncation=True, max_length=max_length,
                                       return_tensors="pt")).last_hidden_state[0]
            vector = hidden[0] if pooling == "cls" else hidden.mean(0)
            out.append((vector / vector.norm() if normalize else vector).numpy())
    return np.stack(out)


def _corpus(tmp_path, passages=PASSAGES):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "contents": c}) + "\n" for i, c in enumerate(passages)))
    return path


INDEX_PASSAGES = ['"Paris"\nParis is the capital of France', '"Rome"\nRome is a city', 'no title line here',
            '"Nile"\nthe Nile is a river', '"Alps"\nmountains']


def _index_corpus(tmp_path, passages=INDEX_PASSAGES):
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
    vector[INDEX_PASSAGES.index(passage) % 4] = 1.0 + INDEX_PASSAGES.index(passage)
    return vector
