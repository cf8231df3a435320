"""``stppo_agent.distributed.process_group``: a one-process gloo group in
this process, torch.distributed's calls recorded where a second rank would answer -- joining and leaving, DDP and
FSDP2 wrapping, gathered FSDP modules, norms, clipping, whitening, seeds, and a rank's streams in a checkpoint."""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from stppo_agent.distributed import process_group as pg
from tests.support.fakes import Calls


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
