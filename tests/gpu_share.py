"""One GPU shared by the pytest-xdist workers that run GPU tests at once.

The README's test command starts one worker per core (``-n auto``: 14 on a
16-core GPU machine). Each worker that runs a GPU test holds a CUDA context
and whatever its caching allocator, cuBLAS and NCCL keep, and compiles its
kernels on the host first: with fourteen at once, an 80 GB card ran out of
memory in some test or other (OOM, ``CUBLAS_STATUS_ALLOC_FAILED``,
``ncclUnhandledCudaError``), although every test passes alone. So a GPU test
runs only while it holds one of a few *slots* (``slots``: one per
``SLOT_GIB`` of the card's memory, less one for the idle workers' contexts;
``UNIEP_GPU_TEST_SLOTS`` sets the number), a lock file of a folder all the
run's workers share, and gives its cached memory back before it lets go.

A test marked ``gpu_exclusive`` holds every slot: the card is its alone. That
is for tests whose kernels wait on each other's progress under wall-clock
bounds of a few seconds and that measure how fast every rank stops (the
real-rank worlds: one rank's launch spins until a peer's launch, on another
stream, has published): the driver time-slices the card between processes,
so other tests' kernels would stretch those times.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

SLOT_GIB = 16
ENV_SLOTS = "UNIEP_GPU_TEST_SLOTS"


def slots(total_bytes: int, environ: dict[str, str] | None = None) -> int:
    """GPU tests that may run at once on a card of ``total_bytes``."""
    env = os.environ if environ is None else environ
    if env.get(ENV_SLOTS):
        count = int(env[ENV_SLOTS])
        if count < 1:
            raise ValueError(f"{ENV_SLOTS}={env[ENV_SLOTS]!r}: expected a positive number of GPU tests at once")
        return count
    return max(1, total_bytes // (SLOT_GIB << 30) - 1)


@contextlib.contextmanager
def gpu_slot(folder: Path, count: int, poll_s: float = 0.1, exclusive: bool = False):
    """Hold one of ``count`` slots (lock files in ``folder``, which every
    worker of the run shares) for the body, or every slot (``exclusive``);
    waits until they are free (a test's pytest-timeout bounds the wait).
    Yields the slot's index (0 when exclusive)."""
    folder.mkdir(parents=True, exist_ok=True)
    if exclusive:
        with contextlib.ExitStack() as held:
            # Every exclusive holder takes the slots in index order (blocking), so two
            # never hold a part each; a shared holder waits on none while it holds one.
            for index in range(count):
                handle = held.enter_context(open(folder / f"slot{index}", "a+"))
                fcntl.flock(handle, fcntl.LOCK_EX)
                held.callback(fcntl.flock, handle, fcntl.LOCK_UN)
            yield 0
        return
    while True:
        for index in range(count):
            handle = open(folder / f"slot{index}", "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            try:
                yield index
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
                handle.close()
            return
        time.sleep(poll_s)
