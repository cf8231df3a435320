"""One rank of a 2-process gloo test, spawned by ``torch.multiprocessing``: the process group around the rank's
work and the way out (shared by the tests that compare 2 processes with 1)."""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist


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
