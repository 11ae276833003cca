"""The one GPU timer of the benchmarks and probes."""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.distributed as dist


def time_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn()`` after ``warmup`` calls,
    in ms; with a process group, the slowest rank's median (every rank calls
    it together)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        dist.barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    median = statistics.median(start.elapsed_time(end) for start, end in events)
    if not distributed:
        return median
    slowest = torch.tensor([median], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())
