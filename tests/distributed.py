"""Run a test body in W gloo processes on CPU (no ports: a FileStore rendezvous)."""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, fn, world_size: int, init_file: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    # Both ranks leave together, then skip C++ teardown: when one rank's gloo
    # connections close while the other is still destroying its own, gloo's
    # background threads can hit std::terminate ("terminate called without
    # an active exception", SIGABRT) after the test body has passed.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    ``fn`` must be a module-level function; an assertion failing in any rank
    fails the caller with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(fn, world_size, os.path.join(tmp, "store"), args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
