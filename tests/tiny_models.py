"""Tiny, randomly initialised Hugging Face models and tokenizers built from configs, for fast CPU tests: the
package's own builder (``--model tiny``, :mod:`stppo_agent.models.tiny`) at a path of the test's choosing."""

from __future__ import annotations

from pathlib import Path

from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer  # noqa: F401  (re-exported for the tests)


def tiny_llama(path: Path, tokenizer, hidden: int = 32, layers: int = 2, seed: int = 0, tied: bool = False) -> Path:
    """Save a random tiny Llama + ``tokenizer`` as a Hugging Face folder at ``path`` (``tied``: the LM head shares
    the embedding matrix, as in SmolLM2)."""
    return build_tiny_llama(path, tokenizer, hidden=hidden, layers=layers, seed=seed, tied=tied)


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


def tiny_generation_model():
    """(a random 2-layer Llama in memory, the word tokenizer: <pad>=0 <eos>=1 <unk>=2 say ok red green blue gold),
    built under seed 11 without moving the global torch generator: the generation backends' pin tests."""
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


def linear_state(iteration: int = 0):
    """A training state of a linear actor (SGD, a constant rate, no lag) at ``iteration``: for the loop's and its
    collaborators' wiring, where no model needs to compute anything."""
    import torch

    from stppo_agent.training.stale_policy import StalePolicy
    from stppo_agent.training.state import TrainingState

    actor = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(actor.parameters(), lr=0.1)
    return TrainingState(tokenizer=None, actor=actor, actor_optimizer=optimizer,
                         actor_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                         stale_policy=StalePolicy(actor, 0), iteration=iteration)
