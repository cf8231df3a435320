"""The ranks of a 2-process gloo test: how they are started (:func:`start_ranks`) and the process group around each
rank's work and its way out (:func:`gloo_rank`); shared by the tests that compare 2 processes with 1."""

from __future__ import annotations

import contextlib
import multiprocessing
import os

import torch.distributed as dist
import torch.multiprocessing as mp


def start_ranks(fn, args: tuple, nprocs: int, join: bool = True):
    """``torch.multiprocessing.start_processes`` with each rank forked from a fork server that imported ``fn``'s
    module (torch, transformers, the trainer) once, instead of spawned to import them again (~4 s of CPU per rank).
    The server is a fresh single-threaded process: forking the test process instead can hang (its torch thread
    pools, a JVM). One server per test process: the first caller's preload stays, later modules import lazily."""
    multiprocessing.set_forkserver_preload([fn.__module__])
    return mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver", join=join)


@contextlib.contextmanager
def gloo_rank(rank: int, port: int, world: int = 2):
    """Join the group, run the block, wait for every rank, leave. On an error the group is destroyed and the error
    raised (the spawner reports it); on success the process exits at once: gloo's teardown occasionally aborts in
    C++ ("terminate called without an active exception") after all work is done and saved, which would turn a
    passed check into a failure."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()  # every rank is done talking
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)
