"""What the retrieval tests share: a server on a thread, a tiny BERT encoder
folder and a fake encoder."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import stppo_envs  # noqa: F401
from stppo_agent.distributed.process_group import free_port
from stppo_envs.retrieval import dense_build
from tests.support.retrieval_backends import WORDS, _FakeEncoder

# --- server ----------------------------------------------------------------------------------------------------


@pytest.fixture
def threaded_server():
    import uvicorn

    from stppo_envs.retrieval.server import ServerLimits, create_app

    servers = []

    def start(retriever, limits=ServerLimits()):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(retriever, limits), host="127.0.0.1", port=port,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.time() + 20
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}", server

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    """A random 1-layer BERT (hidden 16) with a word-piece vocabulary of WORDS: an encoder in milliseconds."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = tmp_path_factory.mktemp("enc") / "tiny-bert"
    folder.mkdir()
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", '"', ".", ":", *WORDS]
    BertTokenizerFast(vocab={token: i for i, token in enumerate(tokens)}).save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS) + 8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64)
    BertModel(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture
def fake_encoder(monkeypatch):
    _FakeEncoder.made, _FakeEncoder.calls = [], []
    monkeypatch.setattr(dense_build, "TextEncoder", _FakeEncoder)
    return _FakeEncoder
