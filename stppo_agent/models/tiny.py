"""``--model tiny``: a small random Llama over ``stppo/Toy-v0``'s words, built on first use, for seeing a run learn.

A random policy whose whole vocabulary is the toy env's words says the target word often enough to be paid, so
the reward moves within a few iterations on a CPU (SmolLM2 at walk-through settings never says it: reward 0, no
learning signal). It is useless anywhere else: every word outside its vocabulary is ``<unk>``.

The folder is cached under ``$STPPO_CACHE_DIR/models`` and is the same on every machine (seeded, and rebuilt
only when :data:`TINY_VERSION` changes): two runs with ``--model tiny`` start from identical weights.

The same builders at other sizes, paths and tokenizers are what tests/ and benchmarks/ train and time on CPU, with
:func:`tiny_generation_model` (the generation backends' in-memory model) and :func:`toy_train_command` (a short
``stppo train`` on ``stppo/Toy-v0``): one home for them, importable by both.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from stppo_envs.retrieval.factory import cache_dir

TINY_WORDS = ("say", "ok", "red", "green", "blue", "gold")  # the toy env's prompt and its answers
TINY_VERSION = "v1"  # the name of the cached folder: bump it when what build_tiny_llama writes changes


def word_tokenizer(words=TINY_WORDS):
    """A whitespace word-level tokenizer: <pad>=0, <eos>=1, <unk>=2, then ``words``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_tiny_llama(path: Path, tokenizer=None, hidden: int = 32, layers: int = 2, seed: int = 0,
                     tied: bool = False) -> Path:
    """Save a random Llama + ``tokenizer`` (default: :func:`word_tokenizer`) as a Hugging Face folder at ``path``.
    ``tied``: the LM head shares the embedding matrix, as in SmolLM2. The same arguments give the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer if tokenizer is not None else word_tokenizer()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=tied)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)  # building a model must not shift the caller's random stream
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def copy_tokenizer(vocabulary: int = 64):
    """:func:`word_tokenizer` over ``stppo/Copy-v0``'s cue word and symbols: one token per word the env reads."""
    from stppo_envs.copy_task import CUE, copy_symbols

    return word_tokenizer((CUE, *copy_symbols(vocabulary)))


def build_copy_llama(path: Path, vocabulary: int = 64, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A random Llama over :func:`copy_tokenizer` at ``path`` (hidden 64, 2 layers: ~91k parameters), the copy tier's
    model before its supervised warm start (benchmarks/copy_warm_start.py)."""
    return build_tiny_llama(path, copy_tokenizer(vocabulary), hidden=hidden, layers=layers, seed=seed)


def tiny_model_path() -> Path:
    """The cached ``--model tiny`` folder, built (atomically: concurrent first uses are safe) when missing."""
    target = cache_dir() / "models" / f"tiny-llama-{TINY_VERSION}"
    if (target / "BUILT").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = build_tiny_llama(Path(scratch) / "tiny")
        (built / "BUILT").write_text(f"stppo_agent.models.tiny {TINY_VERSION}: a random Llama for stppo/Toy-v0\n")
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(built, target)
        except OSError:
            if not (target / "BUILT").exists():  # another process's finished copy won the race: use it
                raise
    return target


def tiny_generation_model():
    """(a random 2-layer Llama in memory, :func:`word_tokenizer`: <pad>=0 <eos>=1 <unk>=2 say ok red green blue gold),
    built under seed 11 without moving the global torch generator: what the generation backends' tests sample from."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = word_tokenizer()
    state = torch.random.get_rng_state()
    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = LlamaForCausalLM(config)
    torch.random.set_rng_state(state)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    return model, tokenizer


def toy_train_command(model: Path, out: Path, iterations: int, resume: bool = False,
                      extra: tuple[str, ...] = ()) -> list[str]:
    """``stppo train`` (as a subprocess command) of ST-PPO on ``stppo/Toy-v0``, checkpointing every iteration: what
    kill -9 tests and the robustness benchmark interrupt and resume. ``extra``: more ``--set`` items."""
    import sys

    command = [sys.executable, "-m", "stppo_agent.cli", "train", "--algo", "st_ppo", "--env", "stppo/Toy-v0",
               "--model", str(model), "--output-dir", str(out), "--iterations", str(iterations)]
    for item in ("rollout.prompts_per_iteration=8", "rollout.samples_per_prompt=4", "optimizer.mini_batch_size=16",
                 "optimizer.micro_batch_size=8",
                 "optimizer.actor_lr=0.003", "optimizer.critic_lr=0.003", "rollout.max_turns=2",
                 "rollout.max_new_tokens_per_turn=1",
                 "rollout.max_prompt_tokens=8", "rollout.max_total_tokens=32", "logging.progress=false",
                 "logging.tensorboard=false",
                 "checkpoint.every=1", "checkpoint.keep=2", "algorithm.kl_in_reward=0.0", *extra):
        command += ["--set", item]
    return command + (["--resume"] if resume else [])
