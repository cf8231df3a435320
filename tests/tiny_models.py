"""Tiny, randomly initialised Hugging Face models and tokenizers built from configs, for fast CPU tests."""

from __future__ import annotations

from pathlib import Path

TOY_WORDS = ["say", "ok", "red", "green", "blue", "gold"]


def word_tokenizer(words=TOY_WORDS):
    """A whitespace word-level tokenizer: <pad>=0, <eos>=1, <unk>=2, then ``words``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama(path: Path, tokenizer, hidden: int = 32, layers: int = 2, seed: int = 0, tied: bool = False) -> Path:
    """Save a random tiny Llama + ``tokenizer`` as a Hugging Face folder at ``path`` (``tied``: the LM head shares
    the embedding matrix, as in SmolLM2)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
