"""``stppo_agent.models.tiny``: the word tokenizer, the tiny Llama's config and seed (and the
caller's random stream left alone), the cached ``--model tiny`` folder built once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from stppo_agent.models import tiny


# -- tiny: the word tokenizer, the seeded Llama, the cache folder ---------------------------------------------------
def test_tiny_word_tokenizer_ids():
    tokenizer = tiny.word_tokenizer()
    assert tiny.TINY_WORDS == ("say", "ok", "red", "green", "blue", "gold") and tiny.TINY_VERSION == "v1"
    assert tokenizer.get_vocab() == {"<pad>": 0, "<eos>": 1, "<unk>": 2, "say": 3, "ok": 4, "red": 5, "green": 6,
                                     "blue": 7, "gold": 8}
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer("say red  gold purple")["input_ids"] == [3, 5, 8, 2]
    assert tokenizer.decode([3, 5, 8]) == "say red gold"
    assert tiny.word_tokenizer(("a", "b")).get_vocab() == {"<pad>": 0, "<eos>": 1, "<unk>": 2, "a": 3, "b": 4}
    punctuated = tiny.word_tokenizer(("hi", ",", "there"))
    ids = punctuated("hi, there")["input_ids"]
    assert ids == [3, 4, 5] and punctuated.decode(ids) == "hi, there"  # the decoder's clean-up joins the comma


def test_tiny_llama_config_seed_and_the_callers_random_stream(tmp_path):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    path = tiny.build_tiny_llama(tmp_path / "a", hidden=8, layers=1, seed=5, tied=True)
    assert torch.equal(torch.rand(3), expected_next)  # building did not shift the caller's stream
    assert path == tmp_path / "a"
    config = transformers.AutoConfig.from_pretrained(path)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.max_position_embeddings) == (
        9, 8, 16, 1, 4, 4, 512)
    assert (config.pad_token_id, config.eos_token_id, config.bos_token_id, config.tie_word_embeddings) == (
        0, 1, None, True)
    generation = transformers.GenerationConfig.from_pretrained(path)
    assert (generation.eos_token_id, generation.pad_token_id) == (1, 0)
    assert transformers.AutoTokenizer.from_pretrained(path).get_vocab()["gold"] == 8
    same = tiny.build_tiny_llama(tmp_path / "b", hidden=8, layers=1, seed=5, tied=True)
    other = tiny.build_tiny_llama(tmp_path / "c", hidden=8, layers=1, seed=6)
    weights = [transformers.AutoModelForCausalLM.from_pretrained(p).model.embed_tokens.weight for p in (path, same,
                                                                                                          other)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    assert transformers.AutoConfig.from_pretrained(other).tie_word_embeddings is False
    own = tiny.word_tokenizer(("a", "b"))
    default_seed = tiny.build_tiny_llama(tmp_path / "d", own, hidden=8, layers=1)
    seed_zero = tiny.build_tiny_llama(tmp_path / "e", own, hidden=8, layers=1, seed=0)
    assert transformers.AutoConfig.from_pretrained(default_seed).vocab_size == 5
    assert transformers.AutoTokenizer.from_pretrained(default_seed).get_vocab()["b"] == 4
    assert torch.equal(*[transformers.AutoModelForCausalLM.from_pretrained(p).model.embed_tokens.weight
                         for p in (default_seed, seed_zero)])


def test_tiny_llama_defaults_and_the_random_stream_after_an_error(tmp_path, monkeypatch):
    calls = []
    # by dotted name: what `from transformers import ...` reads is sys.modules' transformers
    monkeypatch.setattr("transformers.LlamaConfig", lambda **k: calls.append(k) or SimpleNamespace(**k))

    def broken(config):
        torch.rand(5)
        raise RuntimeError("no model")

    monkeypatch.setattr("transformers.LlamaForCausalLM", broken)
    torch.manual_seed(9)
    expected_next = torch.rand(2)
    torch.manual_seed(9)
    with pytest.raises(RuntimeError, match="no model"):
        tiny.build_tiny_llama(tmp_path / "x")
    assert torch.equal(torch.rand(2), expected_next)
    assert calls == [dict(vocab_size=9, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, pad_token_id=0,
                          eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)]


def test_tiny_model_path_builds_once_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path))
    builds = []

    def build(path):
        builds.append(path)
        path.mkdir()
        (path / "config.json").write_text("{}")
        return path

    monkeypatch.setattr(tiny, "build_tiny_llama", build)
    target = tmp_path / "models" / "tiny-llama-v1"
    target.mkdir(parents=True)
    (target / "partial").write_text("an interrupted build")
    assert tiny.tiny_model_path() == target
    assert builds[0].name == "tiny" and builds[0].parent.parent == target.parent
    assert sorted(p.name for p in target.iterdir()) == ["BUILT", "config.json"]
    assert (target / "BUILT").read_text() == "stppo_agent.models.tiny v1: a random Llama for stppo/Toy-v0\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny-llama-v1"]
    assert tiny.tiny_model_path() == target and len(builds) == 1
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "fresh" / "cache"))  # nothing of it exists yet
    assert tiny.tiny_model_path() == tmp_path / "fresh" / "cache" / "models" / "tiny-llama-v1"


def test_tiny_model_path_a_concurrent_finished_copy_wins_the_race(tmp_path, monkeypatch):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / "tiny-llama-v1"

    def build(path):
        path.mkdir()
        target.mkdir(parents=True, exist_ok=True)
        (target / "BUILT").write_text("the other process's")
        return path

    def replace(src, dst):
        raise OSError("Directory not empty")

    monkeypatch.setattr(tiny, "build_tiny_llama", build)
    removed = []
    monkeypatch.setattr(tiny.shutil, "rmtree", lambda *a, **k: removed.append((a, k)))
    monkeypatch.setattr(tiny.os, "replace", replace)
    assert tiny.tiny_model_path() == target
    assert (target / "BUILT").read_text() == "the other process's"
    # the other process may be deleting or replacing it at the same moment: errors there are not ours
    assert removed[0] == ((target,), {"ignore_errors": True})
    (target / "BUILT").unlink()
    monkeypatch.setattr(tiny, "build_tiny_llama", lambda path: path.mkdir() or path)
    with pytest.raises(OSError, match="Directory not empty"):
        tiny.tiny_model_path()
