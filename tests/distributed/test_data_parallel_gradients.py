"""Two gloo processes compute exactly the gradient one process computes on the same global batch
(tolerance: rtol 1e-5, atol 1e-7 -- float32 sums in another order), clip-bias correction included, under DDP and
under FSDP2 (parameters, gradients and optimizer state sharded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stppo_agent.distributed.shared_retrieval import free_port
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.config_sections import DistributedConfig, LoggingConfig, OptimizerConfig, RolloutConfig
from stppo_agent.training.trainer import Trainer
from tests.support.gloo_ranks import start_ranks


def config(model: Path, out: Path, algo: str, strategy: str = "ddp") -> TrainConfig:
    """``strategy``: ddp, fsdp2, or fsdp2+checkpointing (activation checkpointing recomputes inside both backwards)."""
    return TrainConfig(algo=algo, env="stppo/Toy-v0", model=str(model), output_dir=str(out), iterations=1,
                       algorithm={"kl_in_reward": 0.0, "clip_bias_kappa": 0.01},
                       distributed=DistributedConfig(strategy=strategy.split("+")[0]),
                       optimizer=OptimizerConfig(gradient_checkpointing=strategy.endswith("+checkpointing"),
                                                 mini_batch_size=8, micro_batch_size=2),
                       rollout=RolloutConfig(prompts_per_iteration=8, samples_per_prompt=1, max_turns=2,
                                             max_new_tokens_per_turn=1, max_prompt_tokens=8, max_total_tokens=32),
                       logging=LoggingConfig(progress=False, tensorboard=False))


def _rank_main(rank: int, port: int, model: str, out: str, algo: str, batch_path: str, result_path: str,
               strategy: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.tensor import DTensor

        trainer = Trainer(config(Path(model), Path(out), algo, strategy), report=lambda _: None)
        batch = torch.load(batch_path, weights_only=False)
        local = batch.select(list(range(rank, batch.batch_size, 2)))
        metrics = trainer.actor_gradients(local)
        from stppo_agent.distributed.process_group import distributed_whiten

        whitened = distributed_whiten(local.values, local.loss_mask)
        sharded = [isinstance(p, DTensor) for p in trainer.state.actor.parameters()]
        assert all(sharded) if strategy.startswith("fsdp2") else not any(sharded)
        if strategy.startswith("fsdp2"):  # each rank holds about half of every parameter and gradient (dim-0 shards)
            params = list(trainer.state.actor.parameters())
            held = sum(p.to_local().numel() + p.grad.to_local().numel() for p in params)
            whole = sum(2 * p.numel() for p in params)
            assert held <= whole / 2 + 2 * sum(p.numel() // p.shape[0] for p in params)
        # gathering FSDP2 shards is a collective: every rank takes part
        grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                 for name, p in trainer.state.actor.named_parameters()}
        if rank == 0:
            torch.save({"grads": grads, "metrics": metrics, "whitened": whitened}, result_path)
        else:
            torch.save({"whitened": whitened}, result_path + ".1")
        dist.barrier()  # both ranks are done talking
    except BaseException:
        dist.destroy_process_group()
        raise
    # gloo's teardown occasionally aborts in C++ ("terminate called without an active exception") after all work
    # is done and saved; leave without running destructors so that cannot turn a passed check into a failure
    os._exit(0)


@pytest.mark.parametrize("strategy, tied", [("ddp", False), ("fsdp2", False), ("fsdp2+checkpointing", False),
                                            ("fsdp2", True)])
@pytest.mark.parametrize("algo", ["st_ppo", "s_ppo"])
def test_two_process_gradient_equals_single_process(tmp_path, algo, strategy, tied):
    """``tied``: embeddings shared with the LM head (SmolLM2, Qwen2.5 small models), one root-group parameter."""
    model = build_tiny_llama(tmp_path / "model", word_tokenizer(), tied=tied)
    single = Trainer(config(model, tmp_path / "single", algo), report=lambda _: None)
    batch = single.rollout()
    single.score(batch)
    batch.old_logprobs = batch.old_logprobs + 0.5 * torch.randn(batch.old_logprobs.shape,
                                                                generator=torch.Generator().manual_seed(0))
    batch.values = torch.randn(batch.values.shape, generator=torch.Generator().manual_seed(1))
    torch.save(batch, tmp_path / "batch.pt")
    expected = single.actor_gradients(batch)
    assert expected["clip_frac"] > 0.05 and expected["clip_bias_scale"] > 1.0  # the correction is exercised

    result = tmp_path / "rank0.pt"
    start_ranks(_rank_main, args=(free_port(), str(model), str(tmp_path / "ddp"), algo,
                                      str(tmp_path / "batch.pt"), str(result), strategy), nprocs=2)
    got = torch.load(result, weights_only=False)
    for name, param in single.state.actor.named_parameters():
        torch.testing.assert_close(got["grads"][name], param.grad, rtol=1e-5, atol=1e-7)
    for key in ("clip_bias_norm", "clip_bias_scale", "pg_grad_norm", "clip_frac", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(expected[key], rel=1e-5), key
    # distributed whitening over two halves equals whitening of the whole batch
    from stppo_agent.algorithms.segments import whiten

    full = whiten(batch.values, batch.loss_mask)
    other = torch.load(str(result) + ".1", weights_only=False)["whitened"]
    torch.testing.assert_close(got["whitened"], full[0::2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(other, full[1::2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first, then", [("ddp", "fsdp2"), ("fsdp2", "ddp")])
def test_torchrun_two_processes_then_resume_with_one(tmp_path, first, then):
    """Checkpoints hold full tensors and name-keyed optimizer state: a run resumes with another number of
    processes and the other strategy."""
    import subprocess
    import sys

    from stppo_agent.runs.checkpoint import load_trainer_state
    from stppo_agent.runs.metrics_log import read_metrics

    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    out = tmp_path / "run"

    def command(launcher, iterations, strategy, resume=False):
        args = [*launcher, "-m", "stppo_agent.cli", "train", "--algo", "st_ppo", "--env", "stppo/Toy-v0", "--model",
                str(model), "--output-dir", str(out), "--iterations", str(iterations),
                "--set", f"distributed.strategy={strategy}"]
        for item in ("rollout.prompts_per_iteration=8", "optimizer.mini_batch_size=8", "optimizer.micro_batch_size=2",
                     "rollout.max_turns=2",
                     "rollout.max_new_tokens_per_turn=1", "rollout.max_prompt_tokens=8",
                     "rollout.max_total_tokens=32", "logging.progress=false",
                     "logging.tensorboard=false", "checkpoint.every=1", "optimizer.actor_lr=0.003"):
            args += ["--set", item]
        return args + (["--resume"] if resume else [])

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(command(torchrun, 2, first), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("every iteration's figures in metrics.jsonl") == 1  # the summary, by rank 0 only
    _, state = load_trainer_state(out / "checkpoints" / "step-2")
    assert state["iteration"] == 2 and state["optimizer_steps"] == 2
    done = subprocess.run(command([sys.executable], 4, then, resume=True), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    _, state = load_trainer_state(out / "checkpoints" / "step-4")
    assert state["iteration"] == 4 and state["optimizer_steps"] == 4


def test_torchrun_ranks_share_one_retrieval_server(tmp_path):
    import json
    import subprocess
    import sys

    import requests

    from stppo_agent.models.default_model import smollm2_path
    from stppo_agent.models.loading import load_tokenizer

    model = build_tiny_llama(tmp_path / "model", load_tokenizer(str(smollm2_path())), hidden=16, layers=1)
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "stppo_agent.cli", "train", "--algo", "grpo", "--env", "stppo/NQ-v0", "--model", str(model),
               "--output-dir", str(out), "--iterations", "1"]
    for item in ("rollout.prompts_per_iteration=2", "rollout.samples_per_prompt=2", "optimizer.mini_batch_size=4",
                 "optimizer.micro_batch_size=2",
                 "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=8", "rollout.max_prompt_tokens=512",
                 "rollout.max_total_tokens=1024",
                 "logging.progress=false", "logging.tensorboard=false", "env_kwargs.retriever=demo"):
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    server = json.loads((out / "retrieval_server.json").read_text())
    assert server["spec"] == "demo" and server["url"].startswith("http://127.0.0.1:")
    with pytest.raises(requests.ConnectionError):  # stopped with the run
        requests.get(server["url"] + "/health", timeout=2)


def test_two_node_rendezvous_on_one_host(tmp_path):
    """torchrun's c10d rendezvous with two 'nodes' of one process each (both on loopback)."""
    import subprocess
    import sys

    from stppo_agent.runs.checkpoint import load_trainer_state

    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    out = tmp_path / "run"
    port = free_port()

    def node(rank: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                   "--node_rank", str(rank), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
                   "--rdzv_id", "stppo-test", "-m", "stppo_agent.cli", "train", "--algo", "st_ppo", "--env",
                   "stppo/Toy-v0", "--model", str(model), "--output-dir", str(out), "--iterations", "2"]
        for item in ("rollout.prompts_per_iteration=8", "optimizer.mini_batch_size=8", "optimizer.micro_batch_size=2",
                     "rollout.max_turns=2",
                     "rollout.max_new_tokens_per_turn=1", "rollout.max_prompt_tokens=8",
                     "rollout.max_total_tokens=32", "logging.progress=false",
                     "logging.tensorboard=false"):
            command += ["--set", item]
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    nodes = [node(0), node(1)]
    for process in nodes:
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
    _, state = load_trainer_state(out / "checkpoints" / "step-2")
    assert state["iteration"] == 2 and state["optimizer_steps"] == 2


def _uneven_generation_main(rank: int, port: int, model_path: str, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from transformers import AutoModelForCausalLM

    from stppo_agent.distributed.process_group import gathered, shard_fsdp2

    model = AutoModelForCausalLM.from_pretrained(model_path)
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    shard_fsdp2(model)
    ids = torch.tensor([[3, 4, 5, 6]])
    with gathered(model), torch.no_grad():
        for _ in range(1 + 3 * rank):  # as many forwards as this rank's episodes need: differs between ranks
            model(input_ids=ids)
    model(input_ids=ids).logits.sum().backward()  # sharded again: collectives line up
    full = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
    if rank == 0:
        torch.save({"expected": expected, "full": full}, result_path)
    dist.barrier()
    os._exit(0)


def test_fsdp2_gathered_generation_needs_no_lock_step(tmp_path):
    """Inside ``gathered`` an FSDP2 model's forwards do not communicate, so ranks may run different numbers of
    them (generation); afterwards the model is sharded again with unchanged weights."""
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    context = start_ranks(_uneven_generation_main, args=(free_port(), str(model), str(tmp_path / "r.pt")),
                              nprocs=2, join=False)
    import time

    deadline = time.time() + 120
    while not context.join(timeout=1):
        if time.time() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("FSDP2 ranks deadlocked: a forward inside gathered() communicated")
    got = torch.load(tmp_path / "r.pt", weights_only=False)
    for name, tensor in got["expected"].items():
        torch.testing.assert_close(got["full"][name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("compute_dtype", [None, "bfloat16"])
def test_fsdp2_in_one_process_trains(tmp_path, compute_dtype):
    """distributed.strategy=fsdp2 without torchrun: a one-process group and a one-way mesh; the run trains and saves a
    plain Hugging Face checkpoint. With a bf16 compute dtype the master weights (and so the checkpoint) stay float32."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    out = tmp_path / "run"
    command = [sys.executable, "-m", "stppo_agent.cli", "train", "--algo", "st_ppo", "--env", "stppo/Toy-v0",
               "--model", str(model), "--output-dir", str(out), "--iterations", "2"]
    for item in ("distributed.strategy=fsdp2", "rollout.prompts_per_iteration=8", "optimizer.mini_batch_size=8",
                 "optimizer.micro_batch_size=2",
                 "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=1", "rollout.max_prompt_tokens=8",
                 "rollout.max_total_tokens=32",
                 "logging.progress=false", "logging.tensorboard=false"):
        command += ["--set", item]
    if compute_dtype:
        command += ["--set", f"precision.fsdp_compute_dtype={compute_dtype}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step-2" / "actor", dtype="auto")
    assert all(p.dtype == torch.float32 for p in trained.parameters())
    initial = AutoModelForCausalLM.from_pretrained(model)
    changed = [not torch.equal(a, b) for a, b in zip(trained.parameters(), initial.parameters())]
    assert any(changed)


def test_a_finished_command_leaves_its_process_group(tmp_path):
    """A process that exits still holding a gloo group can abort at shutdown (SIGABRT, "terminate called without
    an active exception") and fail a run that finished: `stppo train` leaves the group when it ends."""
    from stppo_agent.cli import main

    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    args = ["train", "--algo", "grpo", "--env", "stppo/Toy-v0", "--model", str(model), "--output-dir",
            str(tmp_path / "run"), "--iterations", "1"]
    for item in ("distributed.strategy=fsdp2", "rollout.prompts_per_iteration=2", "rollout.samples_per_prompt=2",
                 "optimizer.mini_batch_size=4",
                 "optimizer.micro_batch_size=2", "rollout.max_turns=1", "rollout.max_new_tokens_per_turn=1",
                 "rollout.max_prompt_tokens=8",
                 "rollout.max_total_tokens=16", "logging.progress=false",
                 "logging.tensorboard=false"):  # fsdp2 makes a one-process group
        args += ["--set", item]
    assert main(args) == 0
    assert not dist.is_initialized()


def _scoring_main(rank: int, port: int, model: str, out: str, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from stppo_agent.training.log_probs import token_logprobs

    trainer = Trainer(config(Path(model), Path(out), "st_ppo", "fsdp2"), report=lambda _: None)
    batch = trainer.rollout()
    trainer.score(batch)  # gathered forwards
    with torch.no_grad():
        sharded, _ = token_logprobs(trainer.state.actor, batch)  # one sharded forward (collective)
    same = torch.equal(torch.where(batch.loss_mask, batch.old_logprobs, 0.0),
                       torch.where(batch.loss_mask, sharded, 0.0))
    torch.save({"same": same, "tokens": int(batch.loss_mask.sum())}, f"{result_path}.{rank}")
    dist.barrier()
    os._exit(0)


def test_fsdp2_scoring_on_gathered_weights_matches_the_sharded_forward(tmp_path):
    """Old log-probs come from gathered weights (one all-gather per model); they must be exactly what the
    sharded training forward computes, or the first update would not be on-policy."""
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    start_ranks(_scoring_main, args=(free_port(), str(model), str(tmp_path / "run"), str(tmp_path / "r")),
                    nprocs=2)
    for rank in range(2):
        result = torch.load(f"{tmp_path / 'r'}.{rank}", weights_only=False)
        assert result["tokens"] > 0 and result["same"]


def _mixed_precision_main(rank: int, port: int, model_path: str, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    from transformers import AutoModelForCausalLM

    from stppo_agent.distributed.process_group import shard_fsdp2

    model = shard_fsdp2(AutoModelForCausalLM.from_pretrained(model_path), torch.bfloat16)
    logits = model(input_ids=torch.tensor([[3, 4, 5]])).logits
    logits.float().sum().backward()
    torch.save({"compute": logits.dtype, "master": {p.dtype for p in model.parameters()},
                "grads": {p.grad.dtype for p in model.parameters()}}, result_path)
    os._exit(0)


def test_fsdp2_compute_dtype_computes_in_bf16_and_keeps_float32_master_weights(tmp_path):
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    start_ranks(_mixed_precision_main, args=(free_port(), str(model), str(tmp_path / "r.pt")), nprocs=1)
    got = torch.load(tmp_path / "r.pt", weights_only=False)
    assert got["compute"] == torch.bfloat16
    assert got["master"] == {torch.float32} and got["grads"] == {torch.float32}
