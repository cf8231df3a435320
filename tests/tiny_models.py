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


def toy_train_command(model: Path, out: Path, iterations: int, resume: bool = False,
                      extra: tuple[str, ...] = ()) -> list[str]:
    """``stppo train`` (as a subprocess command) of ST-PPO on ``stppo/Toy-v0``, checkpointing every iteration: what
    kill -9 tests interrupt and resume. ``extra``: more ``--set`` items."""
    import sys

    command = [sys.executable, "-m", "stppo_agent.cli", "train", "--algo", "st_ppo", "--env", "stppo/Toy-v0",
               "--model", str(model), "--output-dir", str(out), "--iterations", str(iterations)]
    for item in ("prompts_per_iteration=8", "samples_per_prompt=4", "mini_batch_size=16", "micro_batch_size=8",
                 "actor_lr=0.003", "critic_lr=0.003", "max_turns=2", "max_new_tokens_per_turn=1",
                 "max_prompt_tokens=8", "max_total_tokens=32", "progress=false", "tensorboard=false",
                 "save_every=1", "keep_checkpoints=2", "algorithm.kl_in_reward=0.0", *extra):
        command += ["--set", item]
    return command + (["--resume"] if resume else [])
