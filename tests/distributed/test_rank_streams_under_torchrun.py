"""Each torchrun rank samples from its own random streams, and a resumed run continues every rank's exactly."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

from stppo_agent.distributed.process_group import rank_seed
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer


def test_rank_seeds():
    assert rank_seed(0, 0) == 0 and rank_seed(1234, 0) == 1234  # one process samples as it always did
    seeds = {rank_seed(seed, rank) for seed in range(4) for rank in range(4)}
    assert len(seeds) == 16  # rank 1 of seed 0 is not rank 0 of seed 1, as seed + rank would be
    assert rank_seed(7, 3) == rank_seed(7, 3) < 2**32


def train(model: Path, out: Path, iterations: int, resume: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "stppo_agent.cli", "train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", str(model),
               "--output-dir", str(out), "--iterations", str(iterations)]
    for item in ("rollout.prompts_per_iteration=4", "rollout.samples_per_prompt=2", "optimizer.mini_batch_size=8",
                 "optimizer.micro_batch_size=4",
                 "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=2", "rollout.max_prompt_tokens=8",
                 "rollout.max_total_tokens=32",
                 "optimizer.actor_lr=0.003", "checkpoint.every=1", "checkpoint.keep=3", "logging.save_rollouts=true",
                 "logging.progress=false",
                 "logging.tensorboard=false"):
        command += ["--set", item]
    done = subprocess.run(command + (["--resume"] if resume else []), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-1500:] + "\n--- stderr ---\n" + done.stderr[-3000:]
    return done


def test_ranks_sample_their_own_tokens_and_resume_continues_each_rank(tmp_path):
    from safetensors.torch import load_file

    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    train(model, run, 2)

    def sampled(folder: Path, iteration: int, rank: int) -> dict[str, torch.Tensor]:
        return load_file(folder / "rollouts" / f"iter-{iteration:06d}.rank-{rank}.safetensors")

    # the toy env gives every episode the same prompt: with one shared stream both ranks drew the same tokens
    first = [sampled(run, 1, rank) for rank in range(2)]
    assert not torch.equal(first[0]["response_ids"], first[1]["response_ids"])

    # resume from the checkpoint of iteration 1: both ranks sample iteration 2 as the uninterrupted run did
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-2")
    done = train(model, resumed, 2, resume=True)
    assert "resumed from" in done.stdout + done.stderr
    for rank in range(2):
        again, before = sampled(resumed, 2, rank), sampled(run, 2, rank)
        assert all(torch.equal(again[name], before[name]) for name in before), rank
    final = "checkpoints/step-2/actor/model.safetensors"
    expected, got = load_file(run / final), load_file(resumed / final)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
