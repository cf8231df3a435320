"""Pins for the process group, the shared retrieval server and the plugin loader and name checks (issue 27): the
existing tests start torchrun or `stppo` subprocesses, where mutants are not switched on. Here: a one-process gloo
group in this process, torch.distributed's calls recorded where a second rank would be needed, the server's process
and health checks replaced by recorders, plugin files written to tmp_path (sys.modules and sys.path restored)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from datetime import timedelta
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import requests
import torch
import torch.distributed as dist

from stppo_agent.distributed import process_group as pg
from stppo_agent.distributed import shared_retrieval as sr
from stppo_agent.plugins import loader, name_checks


class Calls(list):
    """Records calls as (name, args, kwargs); ``fn(name, result)`` makes a recording stand-in."""

    def fn(self, name, result=None):
        def record(*args, **kwargs):
            self.append((name, args, kwargs))
            return result(*args, **kwargs) if callable(result) else result
        return record


# -- process_group -------------------------------------------------------------------------------------------------
def test_process_group_one_real_gloo_process(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    join = dist.init_process_group  # a wrong rank or world size fails in seconds instead of gloo's 30 minutes
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: join(*a, **k, timeout=timedelta(seconds=5)))
    assert not dist.is_initialized()
    assert (pg.rank(), pg.world_size(), pg.is_main(), pg.all_gather_objects({"a": 1})) == (0, 1, True, [{"a": 1}])
    model = torch.nn.Linear(2, 1)
    assert pg.wrap_ddp(model, torch.device("cpu")) is model
    pg.barrier()  # a no-op without a group
    pg.ensure_process_group()
    try:
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert (pg.rank(), pg.world_size(), pg.is_main()) == (0, 1, True)
        assert pg.all_gather_objects(("host", "url")) == [("host", "url")]
        value = torch.tensor([1.0, 2.0])
        total = pg.all_reduce_sum(value)
        assert torch.equal(total, value) and total is not value
        wrapped = pg.wrap_ddp(model, torch.device("cpu"))
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and wrapped.device_ids is None
        pg.barrier()
        pg.ensure_process_group()  # joined already: nothing happens
        assert pg.init_from_env() is True
    finally:
        dist.destroy_process_group()
    assert pg.init_from_env() is False


def test_process_group_rank_and_world_come_from_the_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    assert (pg.rank(), pg.world_size(), pg.is_main()) == (3, 4, False)
    calls = Calls()
    monkeypatch.setattr(dist, "all_gather_object", calls.fn("gather", lambda out, v: out.__setitem__(
        slice(None), [v, "b", "c", "d"])))
    assert pg.all_gather_objects("a") == ["a", "b", "c", "d"]
    assert calls[0][1][0] == ["a", "b", "c", "d"] and calls[0][1][1] == "a"
    monkeypatch.setattr(dist, "all_reduce", calls.fn("all_reduce", lambda t, op: t.mul_(4)))
    value = torch.tensor([1.0])
    assert torch.equal(pg.all_reduce_sum(value), torch.tensor([4.0])) and torch.equal(value, torch.tensor([1.0]))
    assert calls[-1][2] == {"op": dist.ReduceOp.SUM}
    monkeypatch.setattr(dist, "barrier", calls.fn("barrier"))
    pg.barrier()
    assert calls[-1][0] == "barrier"


def test_process_group_joins_torchruns_group_only_for_two_or_more(monkeypatch):
    calls = Calls()
    monkeypatch.setattr(dist, "init_process_group", calls.fn("init"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert pg.init_from_env() is False
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert pg.init_from_env() is False and calls == []
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert pg.init_from_env() is True
    assert calls == [("init", (), {"backend": "gloo"})]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert pg.init_from_env() is True and len(calls) == 1


def test_process_group_backend_binds_the_local_gpu_first(monkeypatch):
    calls = Calls()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", calls.fn("set_device"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert pg._backend() == "nccl" and calls == [("set_device", (0,), {})]
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert pg._backend() == "nccl" and calls[-1] == ("set_device", (2,), {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pg._backend() == "gloo" and len(calls) == 2


def test_process_group_for_a_command_meets_at_a_barrier_then_leaves(monkeypatch):
    calls = Calls()
    state = {"up": False}
    monkeypatch.setattr(pg, "init_from_env", lambda: calls.append("init") or state.update(up=True))
    monkeypatch.setattr(dist, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(pg.gc, "collect", lambda: calls.append("collect"))
    with pg.process_group_for_command():
        calls.append("work")
    assert calls == ["init", "work", "collect", "barrier", "destroy"]
    calls.clear()
    with pytest.raises(RuntimeError, match="failed"):
        with pg.process_group_for_command():
            raise RuntimeError("failed")
    assert calls == ["init"]  # other ranks may be inside a collective: no barrier, the group left as it is
    calls.clear()
    monkeypatch.setattr(pg, "init_from_env", lambda: calls.append("init"))
    state["up"] = False
    with pg.process_group_for_command():
        pass
    assert calls == ["init"]


def test_what_a_command_left_in_reference_cycles_is_gone_before_it_leaves_the_group(monkeypatch):
    """A trainer sits in reference cycles and its DDP model holds the group: freed only by the cyclic collector,
    it outlived destroy_process_group and took gloo's threads down in interpreter finalization (an abort)."""
    import gc
    import weakref

    class Holder:  # stands for the trainer and its DDP model
        pass

    state, alive_at_destroy = {"up": False}, []
    monkeypatch.setattr(pg, "init_from_env", lambda: state.update(up=True))
    monkeypatch.setattr(dist, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: alive_at_destroy.append(held() is not None))
    gc.disable()  # only the command's own collection may free the cycle
    try:
        with pg.process_group_for_command():
            holder = Holder()
            holder.itself = holder
            held = weakref.ref(holder)
            del holder
    finally:
        gc.enable()
    assert alive_at_destroy == [False]


def test_process_group_a_one_process_group_for_fsdp2(monkeypatch):
    calls = Calls()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", calls.fn("init"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(pg, "free_port", lambda: 4567)
    for key in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    pg.ensure_process_group()
    assert calls == [("init", (), {"backend": "gloo", "init_method": "tcp://127.0.0.1:4567", "rank": 0,
                                   "world_size": 1})]
    assert "RANK" not in os.environ
    calls.clear()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    pg.ensure_process_group()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1")
    assert calls == [("init", (), {"backend": "gloo", "init_method": "env://", "rank": 0, "world_size": 1})]
    calls.clear()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    pg.ensure_process_group()
    assert calls == [("init", (), {"backend": "gloo"})] and os.environ["RANK"] == "1"
    calls.clear()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    pg.ensure_process_group()
    assert calls == []


def test_process_group_ddp_on_a_gpu_names_its_device(monkeypatch):
    calls = Calls()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", calls.fn("ddp", "wrapped"))
    model = torch.nn.Linear(1, 1)
    assert pg.wrap_ddp(model, torch.device("cuda", 2)) == "wrapped"
    assert pg.wrap_ddp(model, torch.device("cpu")) == "wrapped"
    assert calls == [("ddp", (model,), {"device_ids": [2]}), ("ddp", (model,), {"device_ids": None})]


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)


class _Net(torch.nn.Module):
    _no_split_modules = ["_Block"]

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(2, 1)


def test_process_group_fsdp2_shards_every_block_then_the_root(monkeypatch):
    import torch.distributed.fsdp as fsdp

    calls = Calls()
    monkeypatch.setattr(fsdp, "fully_shard", calls.fn("shard"))
    monkeypatch.setattr(fsdp, "MixedPrecisionPolicy", lambda **k: ("policy", k))
    net = _Net()
    assert pg.shard_fsdp2(net, torch.bfloat16) is net
    policy = ("policy", {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32})
    assert calls == [("shard", (net.blocks[0],), {"reshard_after_forward": True, "mp_policy": policy}),
                     ("shard", (net.blocks[1],), {"reshard_after_forward": True, "mp_policy": policy}),
                     ("shard", (net,), {"reshard_after_forward": False, "mp_policy": policy})]
    calls.clear()
    pg.shard_fsdp2(net)
    assert [c[2]["mp_policy"] for c in calls] == [("policy", {})] * 3
    plain = torch.nn.Sequential(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"^Sequential names no transformer block class in _no_split_modules "
                                         r"\(\[\]\); FSDP2 needs one to shard layer by layer: use strategy=ddp$"):
        pg.shard_fsdp2(plain)
    odd = _Net()
    odd._no_split_modules = ["Missing", "Other"]
    with pytest.raises(ValueError, match=r"\(\['Missing', 'Other'\]\)"):
        pg.shard_fsdp2(odd)
    assert pg.STRATEGIES == ("ddp", "fsdp2")


def test_process_group_gathered_holds_every_fsdp_module_then_reshards(monkeypatch):
    import torch.distributed.fsdp as fsdp

    class FakeFSDP(torch.nn.Module):
        def __init__(self, log, name, child=None):
            super().__init__()
            self.log, self.name, self.child = log, name, child

        def set_reshard_after_forward(self, value, recurse):
            self.log.append((self.name, "reshard_after_forward", value, recurse))

        def unshard(self):
            self.log.append((self.name, "unshard"))

        def reshard(self):
            self.log.append((self.name, "reshard"))

    monkeypatch.setattr(fsdp, "FSDPModule", FakeFSDP)
    log = []
    root = FakeFSDP(log, "root", FakeFSDP(log, "block"))
    with pg.gathered(root) as held:
        assert held is root
        assert log == [("root", "reshard_after_forward", False, False), ("root", "unshard"),
                       ("block", "reshard_after_forward", False, False), ("block", "unshard")]
        log.clear()
    assert log == [("root", "reshard"), ("root", "reshard_after_forward", False, False),
                   ("block", "reshard"), ("block", "reshard_after_forward", True, False)]
    log.clear()
    with pytest.raises(KeyError):
        with pg.gathered(root):
            log.clear()
            raise KeyError("generation failed")
    assert [entry[1] for entry in log] == ["reshard", "reshard_after_forward"] * 2
    plain = torch.nn.Linear(1, 1)
    with pg.gathered(plain) as held:
        assert held is plain


def test_process_group_norms_in_float32_or_float64_and_over_shards(monkeypatch):
    import torch.distributed.tensor as dtensor

    assert torch.equal(pg.global_norm([], torch.device("cpu")), torch.zeros(()))
    assert pg.global_norm([], torch.device("meta")).device.type == "meta"  # on the device asked for
    norm = pg.global_norm([torch.tensor([3.0]), torch.tensor([[4.0, 12.0]])], torch.device("cpu"))
    assert norm.dtype == torch.float32 and norm.item() == 13.0
    half = pg.global_norm([torch.tensor([3.0, 4.0], dtype=torch.bfloat16)], torch.device("cpu"))
    assert half.dtype == torch.float32 and half.item() == 5.0
    big = torch.full((4,), 300.0, dtype=torch.float16)  # its squares overflow float16
    assert pg.global_norm([big], torch.device("cpu")).item() == 600.0
    exact = pg.global_norm([torch.tensor([1.0]), torch.tensor([1e-9], dtype=torch.float64)], torch.device("cpu"))
    assert exact.dtype == torch.float64 and exact.item() == (1 + 1e-18) ** 0.5

    class FakeDTensor(torch.Tensor):
        pass

    shard = torch.tensor([3.0, 4.0]).as_subclass(FakeDTensor)
    shard.to_local = lambda: torch.tensor([6.0, 8.0])
    monkeypatch.setattr(dtensor, "DTensor", FakeDTensor)
    assert pg.local_tensor(shard).tolist() == [6.0, 8.0]
    plain = torch.tensor([1.0])
    assert pg.local_tensor(plain) is plain
    calls = Calls()
    monkeypatch.setattr(dist, "all_reduce", calls.fn("all_reduce", lambda t, op: t.mul_(4)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert pg.global_norm([shard], torch.device("cpu")).item() == 10.0 and calls == []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert pg.global_norm([plain], torch.device("cpu")).item() == 1.0 and calls == []
    assert pg.global_norm([shard, plain], torch.device("cpu")).item() == pytest.approx((4 * 101) ** 0.5)
    assert calls[0][2] == {"op": dist.ReduceOp.SUM}


def test_process_group_clip_grad_norm_returns_a_plain_total(monkeypatch):
    import torch.distributed.tensor as dtensor

    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([3.0, 4.0])
    norm = pg.clip_grad_norm([weight], 1.0)
    assert norm.item() == pytest.approx(5.0) and weight.grad.tolist() == pytest.approx([0.6, 0.8], abs=1e-5)

    class FakeDTensor:
        def full_tensor(self):
            return "full"

    monkeypatch.setattr(dtensor, "DTensor", FakeDTensor)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda p, m: FakeDTensor())
    assert pg.clip_grad_norm([weight], 1.0) == "full"


def test_process_group_whitening_uses_the_masked_entries_only():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0, 6.0])
    mask = torch.tensor([True, True, True, False, True])
    out = pg.distributed_whiten(x, mask, eps=0.0)
    chosen = x[mask]
    expected = (chosen - chosen.mean()) / chosen.std(unbiased=True)
    assert torch.allclose(out[mask], expected) and out[3] == 0
    single = pg.distributed_whiten(torch.tensor([5.0, 9.0]), torch.tensor([True, False]), eps=1.0)
    assert single.tolist() == [0.0, 0.0]
    eps = pg.distributed_whiten(torch.tensor([0.0, 2.0]), torch.tensor([True, True]), eps=2.0)
    assert eps.tolist() == pytest.approx([-0.5, 0.5])  # var 2 (unbiased) + eps 2 = 4
    default = pg.distributed_whiten(torch.tensor([0.0, 0.0]), torch.tensor([True, True]))
    assert default.tolist() == [0.0, 0.0]
    tiny = pg.distributed_whiten(torch.tensor([0.0, 2e-4]), torch.tensor([True, True]))
    assert tiny.tolist() == pytest.approx([-1e-4 / (2e-8 + 1e-8) ** 0.5, 1e-4 / (2e-8 + 1e-8) ** 0.5], rel=1e-3)
    none = pg.distributed_whiten(torch.tensor([1.0, 2.0]), torch.tensor([False, False]))
    assert none.tolist() == [0.0, 0.0]


def test_process_group_rank_seeds_and_seeding():
    assert pg.rank_seed(7, 0) == 7
    assert pg.rank_seed(7, 1) == int(np.random.SeedSequence([7, 1]).generate_state(1)[0])
    assert pg.rank_seed(7, 1) == 369571992
    assert len({pg.rank_seed(7, r) for r in range(4)}) == 4 and pg.rank_seed(8, 1) != pg.rank_seed(7, 1)
    assert pg.rank_seed(-1, 2) == pg.rank_seed(2**64 - 1, 2)
    assert 0 <= pg.rank_seed(2**70, 3) < 2**32
    import random

    pg.seed_everything(2**32 + 5)
    drawn = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(2**32 + 5)
    np.random.seed(5)
    torch.manual_seed(2**32 + 5)
    assert drawn == (random.random(), np.random.rand(), torch.rand(1).item())
    pg.seed_everything(6)
    assert np.random.rand() != drawn[1] and random.random() != drawn[0]


def test_process_group_free_port_is_bindable_on_loopback():
    import socket

    port = pg.free_port()
    assert 1024 <= port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# -- shared_retrieval ------------------------------------------------------------------------------------------------
def test_shared_retrieval_local_specs():
    assert sr.is_local_spec("bm25:/idx") and sr.is_local_spec("demo")
    assert not sr.is_local_spec("http://h:1") and not sr.is_local_spec("https://h")
    assert not sr.is_local_spec(object()) and not sr.is_local_spec(None)
    assert (sr.PR_SET_PDEATHSIG, sr.PARENT_ENV) == (1, "STPPO_STOP_WITH_PID")


def test_shared_retrieval_a_child_is_told_its_parent(monkeypatch):
    calls = Calls()
    monkeypatch.setattr(subprocess, "Popen", calls.fn("popen", "process"))
    monkeypatch.setenv("SOME_SETTING", "kept")
    assert sr.spawn_tied_to_this_process(["cmd", "x"], stdout=1) == "process"
    (_, args, kwargs), = calls
    assert args == (["cmd", "x"],) and kwargs["stdout"] == 1
    assert kwargs["env"]["STPPO_STOP_WITH_PID"] == str(os.getpid()) and kwargs["env"]["SOME_SETTING"] == "kept"
    assert "STPPO_STOP_WITH_PID" not in os.environ
    sr.spawn_tied_to_this_process(["cmd"], env={"ONLY": "this"})
    assert calls[-1][2] == {"env": {"ONLY": "this", "STPPO_STOP_WITH_PID": str(os.getpid())}}


def test_shared_retrieval_a_child_asks_the_kernel_for_sigterm_when_its_parent_dies(monkeypatch):
    import ctypes

    calls = Calls()
    libc = SimpleNamespace(prctl=calls.fn("prctl"))
    monkeypatch.setattr(ctypes, "CDLL", calls.fn("cdll", libc))
    monkeypatch.setattr(os, "kill", calls.fn("kill"))
    monkeypatch.delenv("STPPO_STOP_WITH_PID", raising=False)
    sr.stop_with_parent()
    assert calls == []
    monkeypatch.setenv("STPPO_STOP_WITH_PID", str(os.getppid()))
    sr.stop_with_parent()
    assert calls == [("cdll", (None,), {"use_errno": True}), ("prctl", (1, signal.SIGTERM), {})]
    assert "STPPO_STOP_WITH_PID" not in os.environ  # its own children are not tied to its parent
    calls.clear()
    monkeypatch.setenv("STPPO_STOP_WITH_PID", str(os.getppid() + 100000))
    sr.stop_with_parent()
    assert calls[-1] == ("kill", (os.getpid(), signal.SIGTERM), {})
    calls.clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv("STPPO_STOP_WITH_PID", "1")
    sr.stop_with_parent()
    assert calls == [] and "STPPO_STOP_WITH_PID" not in os.environ


class _Process:
    def __init__(self, exits_after=None, hangs=False):
        self.polls, self.exits_after, self.hangs, self.log = 0, exits_after, hangs, []

    def poll(self):
        self.polls += 1
        return 1 if self.exits_after is not None and self.polls > self.exits_after else None

    def terminate(self):
        self.log.append("terminate")

    def wait(self, timeout):
        self.log.append(("wait", timeout))
        if self.hangs:
            raise subprocess.TimeoutExpired("serve", timeout)

    def kill(self):
        self.log.append("kill")


@pytest.fixture
def server_recorders(monkeypatch):
    calls = Calls()
    monkeypatch.setattr(sr, "free_port", lambda: 5151)
    monkeypatch.setattr(sr.atexit, "register", calls.fn("atexit"))
    monkeypatch.setattr(sr.time, "sleep", calls.fn("sleep"))
    return calls


def test_shared_retrieval_the_server_command_its_health_check_and_record(tmp_path, monkeypatch, server_recorders):
    process = _Process()
    monkeypatch.setattr(sr, "spawn_tied_to_this_process", server_recorders.fn("spawn", process))
    answers = iter([requests.ConnectionError("not yet"), SimpleNamespace(ok=False), SimpleNamespace(ok=True)])

    def get(url, timeout):
        server_recorders.append(("get", (url,), {"timeout": timeout}))
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(sr.requests, "get", get)
    assert sr.start_server("bm25:/idx", tmp_path) == "http://127.0.0.1:5151"
    spawn = server_recorders[0]
    assert spawn[1] == ([sys.executable, "-m", "stppo_agent.cli", "serve", "--retriever", "bm25:/idx", "--port",
                         "5151"],)
    assert spawn[2]["stdout"].name == str(tmp_path / "retrieval_server.log") and spawn[2]["stderr"] == \
        subprocess.STDOUT
    assert server_recorders[1] == ("atexit", (sr._stop, process), {})
    assert [c for c in server_recorders[2:]] == [
        ("get", ("http://127.0.0.1:5151/health",), {"timeout": 2}), ("sleep", (0.5,), {}),
        ("get", ("http://127.0.0.1:5151/health",), {"timeout": 2}),
        ("get", ("http://127.0.0.1:5151/health",), {"timeout": 2})]
    assert (tmp_path / "retrieval_server.json").read_text() == \
        '{"spec": "bm25:/idx", "url": "http://127.0.0.1:5151"}\n'


def test_shared_retrieval_a_server_that_exits_or_never_answers(tmp_path, monkeypatch, server_recorders):
    monkeypatch.setattr(sr, "spawn_tied_to_this_process", lambda *a, **k: _Process(exits_after=1))
    monkeypatch.setattr(sr.requests, "get", lambda url, timeout: SimpleNamespace(ok=False))
    with pytest.raises(RuntimeError, match=r"^the shared retrieval server for 'bm25:/i' exited; see "
                                           + str(tmp_path) + "/retrieval_server.log$"):
        sr.start_server("bm25:/i", tmp_path)
    hanging = _Process()
    monkeypatch.setattr(sr, "spawn_tied_to_this_process", lambda *a, **k: hanging)
    clock = iter([100.0, 100.0, 101.0, 102.5])  # the deadline itself is past it
    monkeypatch.setattr(sr.time, "time", lambda: next(clock))
    with pytest.raises(RuntimeError, match=r"^the shared retrieval server for 'dense:/d' did not start within 2 s$"):
        sr.start_server("dense:/d", tmp_path, timeout=2.5)
    assert hanging.log == ["terminate", ("wait", 10)]
    clock = iter([0.0, 0.0, 700.0])
    monkeypatch.setattr(sr.time, "time", lambda: next(clock))
    with pytest.raises(RuntimeError, match=r"did not start within 600 s$"):  # the default: an index may load slowly
        sr.start_server("dense:/d", tmp_path)
    assert not (tmp_path / "retrieval_server.json").exists()


def test_shared_retrieval_stop_terminates_then_kills():
    running, stubborn, done = _Process(), _Process(hangs=True), _Process(exits_after=0)
    sr._stop(running)
    sr._stop(stubborn)
    sr._stop(done)
    assert running.log == ["terminate", ("wait", 10)]
    assert stubborn.log == ["terminate", ("wait", 10), "kill"]
    assert done.log == []


def test_shared_retrieval_each_node_uses_its_first_process_server(tmp_path, monkeypatch):
    calls = Calls()
    monkeypatch.setattr(sr.process_group, "world_size", lambda: 2)
    monkeypatch.setattr(sr.process_group, "rank", lambda: 1)
    monkeypatch.setattr(sr, "start_server", calls.fn("start", "http://127.0.0.1:7000"))
    monkeypatch.setattr(sr.socket, "gethostname", lambda: "node-b")
    gathered = []

    def gather(value):
        gathered.append(value)
        return [("node-a", "http://127.0.0.1:6000"), ("node-a", None), value, ("node-b", None)]

    monkeypatch.setattr(sr.process_group, "all_gather_objects", gather)
    run_dir = tmp_path / "run" / "deep"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert sr.shared_retriever_spec("bm25:/idx", run_dir) == "http://127.0.0.1:7000"
    assert calls == [("start", ("bm25:/idx", run_dir), {})] and run_dir.is_dir()
    assert gathered == [("node-b", "http://127.0.0.1:7000")]
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match=r"^no process on node-b started the shared retrieval server \(is "
                                           r"LOCAL_RANK set\?\)$"):
        sr.shared_retriever_spec("bm25:/idx", run_dir)
    assert gathered[-1] == ("node-b", None) and len(calls) == 1
    monkeypatch.delenv("LOCAL_RANK")  # then the global rank: 1, not the first process
    with pytest.raises(RuntimeError):
        sr.shared_retriever_spec("bm25:/idx", run_dir)
    monkeypatch.setattr(sr.process_group, "rank", lambda: 0)
    assert sr.shared_retriever_spec("bm25:/idx", run_dir) == "http://127.0.0.1:7000"
    assert sr.shared_retriever_spec("http://remote:1", run_dir) == "http://remote:1"
    monkeypatch.setattr(sr.process_group, "world_size", lambda: 1)
    assert sr.shared_retriever_spec("bm25:/idx", tmp_path / "single") == "bm25:/idx"
    assert not (tmp_path / "single").exists() and len(calls) == 2


# -- plugins: --import of files and modules --------------------------------------------------------------------------
@pytest.fixture
def clean_imports(monkeypatch):
    """Plugins imported by a test leave sys.modules and sys.path as they were (the next run imports them again)."""
    before_modules, before_path = set(sys.modules), list(sys.path)
    yield
    for name in set(sys.modules) - before_modules:
        del sys.modules[name]
    sys.path[:] = before_path


def test_loader_import_argument_on_every_command():
    parser = argparse.ArgumentParser()
    loader.add_import_argument(parser)
    assert parser.parse_args([]).imports == []
    assert parser.parse_args(["--import", "a.py", "--import", "pkg.mod"]).imports == ["a.py", "pkg.mod"]
    action = next(a for a in parser._actions if a.dest == "imports")
    assert action.metavar == "FILE_OR_MODULE" and action.help == loader.IMPORT_HELP
    assert action.option_strings == ["--import"]
    recorded = argparse.ArgumentParser()
    loader.add_import_argument(recorded, recorded=True)
    help_text = next(a for a in recorded._actions if a.dest == "imports").help
    assert help_text == loader.IMPORT_HELP + " (recorded in the run's config.yaml for --resume and replay)"
    assert loader.IMPORT_HELP.startswith("import a plugin first: a .py file (./myrule.py)")
    assert loader.IMPORT_HELP.endswith("own. Repeatable") and loader.ENTRY_POINT_GROUP == "stppo.plugins"


def test_loader_files_and_modules_and_their_recorded_form(tmp_path, monkeypatch):
    assert loader.is_file_spec("myrule.py") and loader.is_file_spec("plugins/myrule")
    assert not loader.is_file_spec("my_package.my_algos") and not loader.is_file_spec("py")
    monkeypatch.setattr(loader.os, "sep", "\\")
    assert loader.is_file_spec("plugins\\myrule")
    assert loader.is_file_spec("plugins/myrule")  # a forward slash is a path on every system
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert loader.portable_specs(["./a.py", "pkg.mod", "a.py", "~/b.py", "pkg.mod", "sub/../c.py"]) == [
        str(tmp_path / "a.py"), "pkg.mod", str(tmp_path / "home" / "b.py"), str(tmp_path / "c.py")]


def test_loader_reasons_are_one_line():
    assert loader._reason(RuntimeError("no\n  GPU\there ")) == "RuntimeError: no GPU here"
    assert loader._reason(KeyError()) == "KeyError"
    assert loader._reason(SystemExit("")) == "SystemExit"


def test_loader_a_plugin_file_imports_once_under_its_name(tmp_path, monkeypatch, clean_imports):
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "m27_helper.py").write_text("VALUE = 41\n")
    (folder / "m27_rule.py").write_text("import m27_helper\nimport builtins\nVALUE = m27_helper.VALUE + 1\n"
                                         "builtins.m27_runs = getattr(builtins, 'm27_runs', 0) + 1\n")
    import builtins

    monkeypatch.setattr(builtins, "m27_runs", 0, raising=False)
    monkeypatch.chdir(tmp_path)
    loader.load_plugins(["plugins/m27_rule.py"])
    assert sys.modules["m27_rule"].VALUE == 42 and sys.modules["m27_rule"].__file__ == str(folder / "m27_rule.py")
    assert sys.path.count(str(folder)) == 1 and sys.path[-1] == str(folder)  # appended: never shadows
    loader.load_plugins([str(folder / "m27_rule.py"), "plugins/../plugins/m27_rule.py"])
    assert builtins.m27_runs == 1 and sys.path.count(str(folder)) == 1
    (folder / "m27_second.py").write_text("")
    loader.load_plugins([str(folder / "m27_second.py")])  # a second file of the same folder
    assert sys.path.count(str(folder)) == 1 and "m27_second" in sys.modules
    other = tmp_path / "other"
    other.mkdir()
    (other / "m27_rule.py").write_text("")
    with pytest.raises(ValueError, match=r"^plugin file " + str(other / "m27_rule.py") + r": a module named "
                                         r"'m27_rule' is already imported \(from " + str(folder / "m27_rule.py")
                                         + r"\); rename the file$"):
        loader.load_plugins([str(other / "m27_rule.py")])
    (other / "sys.py").write_text("")
    with pytest.raises(ValueError, match=r"'sys' is already imported \(from a built-in\); rename the file$"):
        loader.load_plugins([str(other / "sys.py")])


def test_loader_a_plugin_file_that_cannot_be_imported(tmp_path, monkeypatch, clean_imports):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^plugin file " + str(tmp_path / "gone.py") + " does not exist$"):
        loader.load_plugins(["gone.py"])
    (tmp_path / "rule.txt").write_text("")
    with pytest.raises(ValueError, match=r"^plugin file " + str(tmp_path / "rule.txt") + " is not a .py file$"):
        loader.load_plugins(["./rule.txt"])
    (tmp_path / "my-rule.py").write_text("")
    with pytest.raises(ValueError, match=r"^plugin file " + str(tmp_path / "my-rule.py") + r": 'my-rule' is not a "
                                         r"valid module name; rename the file \(letters, digits and underscores\)$"):
        loader.load_plugins(["my-rule.py"])
    (tmp_path / "m27_raises.py").write_text("raise RuntimeError('no GPU\\nhere')\n")
    with pytest.raises(ValueError, match=r"^plugin " + str(tmp_path / "m27_raises.py") + " failed to import: "
                                         r"RuntimeError: no GPU here$"):
        loader.load_plugins(["m27_raises.py"])
    assert "m27_raises" not in sys.modules
    (tmp_path / "m27_exits.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ValueError, match=r"failed to import: SystemExit: 3$"):
        loader.load_plugins(["m27_exits.py"])
    assert "m27_exits" not in sys.modules


def test_loader_a_plugin_module_from_the_current_directory(tmp_path, monkeypatch, clean_imports):
    monkeypatch.chdir(tmp_path)
    package = tmp_path / "m27_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "algos.py").write_text("VALUE = 7\n")
    (package / "broken.py").write_text("raise KeyError('bad')\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    loader.load_plugins(["m27_pkg.algos"])
    assert sys.modules["m27_pkg.algos"].VALUE == 7 and sys.path[-1] == str(tmp_path)
    loader.load_plugins(["m27_pkg.algos"])
    assert sys.path.count(str(tmp_path)) == 1
    with pytest.raises(ValueError, match=r"^plugin module 'm27_pkg.broken' \(" + str(package / "broken.py")
                                         + r"\) failed to import: KeyError: 'bad'$"):
        loader.load_plugins(["m27_pkg.broken"])
    with pytest.raises(ValueError, match=r"^cannot import plugin module 'm27_pkg.nothing': no m27_pkg/nothing.py in "
                                         r"the current directory \(" + str(tmp_path) + r"\) and no installed module "
                                         r"of that name; pass a file path \(--import path/to/nothing.py\) or "
                                         r"install it$"):
        loader.load_plugins(["m27_pkg.nothing"])
    (package / "sub").mkdir()
    (package / "sub" / "__init__.py").write_text("")
    with pytest.raises(ValueError, match=r"\(--import path/to/nothing.py\) or install it$"):
        loader.load_plugins(["m27_pkg.sub.nothing"])
    with pytest.raises(ValueError, match=r"^cannot import plugin module 'm27_missing': no m27_missing.py in the "
                                         r"current directory .*\(--import path/to/m27_missing.py\) or install it$"):
        loader.load_plugins(["m27_missing"])
    with pytest.raises(ValueError, match=r"^cannot import plugin module 'm27_nopkg.mod': ModuleNotFoundError: "):
        loader.load_plugins(["m27_nopkg.mod"])
    for bad in (".relative", "a-b", "pkg..mod", "1pkg"):
        with pytest.raises(ValueError, match=r"^plugin '" + bad.replace(".", r"\.") + r"' is neither a module name "
                                             r"\(my_package.my_algos\) nor a .py file$"):
            loader.load_plugins([bad])
    sys.modules["m27_already"] = SimpleNamespace()
    loader.load_plugins(["m27_already"])  # imported already: nothing to find


def test_loader_entry_points_are_imported_once_and_a_broken_one_is_named(monkeypatch):
    loaded, groups = [], []

    def entry_points(group):
        groups.append(group)
        return [SimpleNamespace(name="good", value="pkg.good", load=lambda: loaded.append("good"))]

    monkeypatch.setattr(loader.importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(loader, "_loaded_entry_points", False)
    loader.load_plugins()
    loader.load_plugins([])
    assert loaded == ["good"] and groups == ["stppo.plugins"]

    def broken():
        raise ImportError("missing  dependency\nfoo")

    monkeypatch.setattr(loader.importlib.metadata, "entry_points", lambda group: [
        SimpleNamespace(name="bad", value="pkg.bad:x", load=broken)])
    monkeypatch.setattr(loader, "_loaded_entry_points", False)
    with pytest.raises(ValueError, match=r"^stppo plugin 'bad' \(pkg.bad:x\) failed to import: ImportError: missing "
                                         r"dependency foo$"):
        loader.load_plugins()
    assert loader._loaded_entry_points is True


# -- plugins: the names typed on the command line --------------------------------------------------------------------
def test_name_checks_algorithm_env_and_model_names(tmp_path, monkeypatch):
    name_checks.check_algorithm("st_ppo")
    with pytest.raises(ValueError, match=r"^unknown algorithm 'st_ppp' \(did you mean st_ppo\?\); known: .*; a "
                                         r"plugin's own: --import myrule.py$"):
        name_checks.check_algorithm("st_ppp")
    assert name_checks.check_env_ids(" stppo/Toy-v0 ,, stppo/Toy-v0") == ["stppo/Toy-v0", "stppo/Toy-v0"]
    listing = ", ".join(sorted(i for i in gym.registry if i.startswith("stppo/")))
    with pytest.raises(ValueError) as error:
        name_checks.check_env_ids("stppo/Toy-v0,stppo/Toy-v1")
    assert str(error.value) == ("unknown env id 'stppo/Toy-v1' (did you mean stppo/Toy-v0?); Registered stppo envs: "
                                + listing) and "stppo/Toy-v0, stppo/" in listing
    with pytest.raises(ValueError, match=r"^unknown env id 'CartPole-v9'"):
        name_checks.check_env_ids("CartPole-v9")
    for fine in ("", "smollm2", "hf:SmolLM2", "TINY", "org/smolm2", str(tmp_path), "completely-different-name"):
        name_checks.check_model(fine)
    (tmp_path / "smolm2").mkdir()
    with pytest.raises(ValueError, match=r"^model 'smolm2' is neither a folder nor a known alias \(did you mean "
                                         r"smollm2\?\); aliases: smollm2, tiny; or give a Hugging Face folder or hub "
                                         r"name$"):
        name_checks.check_model("hf:smolm2")
    monkeypatch.chdir(tmp_path)
    name_checks.check_model("smolm2")  # a folder of that name here
    name_checks.check_model("hf:smolm2")


def test_name_checks_retriever_kinds():
    assert name_checks.RETRIEVER_KINDS == ("demo", "bm25", "bm25-prebuilt", "dense", "http", "https")
    for fine in ("demo", " demo ", "bm25:/i", "bm25-prebuilt:wiki", "dense:/d", "http://h:1", "https://h"):
        name_checks.check_retriever(fine)
    with pytest.raises(ValueError, match=r"^bad retriever spec 'bm52' \(did you mean bm25\?\): expected demo, "
                                         r"bm25:INDEX_DIR, bm25-prebuilt:NAME, dense:INDEX_DIR or http://HOST:PORT$"):
        name_checks.check_retriever(" bm52 ")
    with pytest.raises(ValueError, match=r"^unknown retriever kind 'bm52' \(did you mean bm25\?\); known: bm25, "
                                         r"bm25-prebuilt, demo, dense, http, https \(in 'bm52:/i'\)$"):
        name_checks.check_retriever("bm52:/i")
    with pytest.raises(ValueError, match=r"^unknown retriever kind 'Demo' \(did you mean demo\?\)"):
        name_checks.check_retriever("Demo:x")


class _Env(gym.Env):
    def __init__(self, turns: int = 2, *extra, retriever=None):
        pass


class _OpenEnv(gym.Env):
    def __init__(self, **kwargs):
        pass


def test_name_checks_env_kwargs_against_the_constructor(monkeypatch):
    registry = dict(gym.registry)
    monkeypatch.setattr(gym.envs.registration, "registry", registry)
    monkeypatch.setattr(gym, "registry", registry)
    gym.register("m27/Closed-v0", entry_point=_Env)
    gym.register("m27/Open-v0", entry_point=_OpenEnv)
    gym.register("m27/ByName-v0", entry_point=f"{__name__}:_Env")
    gym.register("m27/Broken-v0", entry_point="m27_no_such_module:Env")
    name_checks.check_env_kwargs(["m27/Closed-v0", "m27/ByName-v0"], {"turns": 3, "render_mode": None})
    name_checks.check_env_kwargs(["m27/Open-v0", "m27/Broken-v0"], {"anything": 1})
    for first in ("m27/Open-v0", "m27/Broken-v0"):  # an env that cannot be checked does not end the checks
        with pytest.raises(ValueError, match=r"^env 'm27/Closed-v0' does not accept env_kwargs 'anything'"):
            name_checks.check_env_kwargs([first, "m27/Closed-v0"], {"anything": 1})
    for env_id in ("m27/Closed-v0", "m27/ByName-v0"):
        with pytest.raises(ValueError, match=r"^env '" + env_id + r"' does not accept env_kwargs 'turn' \(did you "
                                             r"mean turns\?\); it accepts: retriever, turns$"):
            name_checks.check_env_kwargs([env_id], {"turns": 1, "turn": 2})
    with pytest.raises(ValueError, match=r"^env 'm27/Closed-v0' does not accept env_kwargs 'extra'"):
        name_checks.check_env_kwargs(["m27/Closed-v0"], {"extra": 1})
    with pytest.raises(ValueError, match=r"^bad retriever spec 'bm52'"):
        name_checks.check_env_kwargs(["m27/Open-v0"], {"retriever": "bm52"})
    name_checks.check_env_kwargs(["m27/Closed-v0"], {"retriever": object()})


def test_name_checks_a_train_config_imports_its_plugins_first(monkeypatch):
    calls = Calls()
    monkeypatch.setattr(name_checks, "load_plugins", calls.fn("plugins"))
    monkeypatch.setattr(name_checks, "check_algorithm", calls.fn("algorithm"))
    monkeypatch.setattr(name_checks, "check_env_ids", calls.fn("env", ["e1", "e2"]))
    monkeypatch.setattr(name_checks, "check_env_kwargs", calls.fn("kwargs"))
    monkeypatch.setattr(name_checks, "check_model", calls.fn("model"))
    config = SimpleNamespace(plugins=["p.py"], algo="a", env="e1,e2", env_kwargs=None, model="m")
    name_checks.check_train_config(config)
    assert calls == [("plugins", (["p.py"],), {}), ("algorithm", ("a",), {}), ("env", ("e1,e2",), {}),
                     ("kwargs", (["e1", "e2"], {}), {}), ("model", ("m",), {})]
    calls.clear()
    name_checks.check_train_config(SimpleNamespace(plugins=[], algo="a", env="e", env_kwargs={"k": 1}, model=""))
    assert [c[0] for c in calls] == ["plugins", "algorithm", "env", "kwargs"] and calls[3][1][1] == {"k": 1}
