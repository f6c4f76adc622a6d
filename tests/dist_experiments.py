"""Experiments for tests/test_distributed.py: the runner's workers import them by name (spawned
processes cannot import functions defined inside a test)."""
import os
import time

import torch
import torch.distributed as dist


def all_reduce_rank(ctx):
    t = torch.full((1024,), float(ctx.rank + 1))
    dist.all_reduce(t)
    return {"sum": float(t[0])}


def raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise RuntimeError("rank one refuses")
    dist.barrier()  # rank 0 waits for rank 1 forever: the runner must stop it
    return {}


def hang_on_rank1(ctx):
    if ctx.rank == 1:
        time.sleep(3600)
    return {}


def die_on_rank0(ctx):
    if ctx.rank == 0:
        os._exit(3)
    dist.barrier()
    return {}


def write_pid_and_sleep(ctx, directory):
    """Each rank writes its pid to ``directory/rank<N>.pid``, then sleeps: a run for killing its parent."""
    import pathlib
    path = pathlib.Path(directory) / f"rank{ctx.rank}.pid"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").rename(path)
    time.sleep(3600)
    return {}
