"""The one GPU timer of the benchmarks, the tuner and the probes.

``time_ms`` times one callable; ``time_alternating`` times several in rounds
of alternating order (first to last, then last to first), building each
path right before its turn and dropping it after, so that no path is always
measured hot (right after itself, with its operands in L2) or always cold,
and only one path's buffers are resident at a time when the builders
allocate them.
"""

from __future__ import annotations

import gc
import statistics
import traceback
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["time_alternating", "time_ms"]


def time_ms(fn: Callable[[], object], warmup: int, reps: int, group: dist.ProcessGroup | None = None) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn()`` after ``warmup`` calls,
    in ms; with a process group, the slowest rank's median (every rank of
    ``group``, default the world, calls it together)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        dist.barrier(group=group)
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
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item())


def alternating_order(names: list[str], rounds: int) -> list[list[str]]:
    """The order of each round: ``names``, then reversed, and so on."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def time_alternating(builders: dict[str, Callable[[], Callable[[], object]]], *, warmup: int, reps: int,
                     rounds: int = 2, group: dist.ProcessGroup | None = None,
                     on_error: Callable[[str, str], None] | None = None,
                     after_each: Callable[[str, float | None], None] | None = None) -> dict[str, float | None]:
    """Median over ``rounds`` of each path's ``time_ms`` (``reps`` timed calls
    per round after ``warmup``), in alternating order. ``builders[name]()``
    returns the callable to time; it is called again every round and its
    result dropped (then ``torch.cuda.empty_cache()``) before the next path
    is built. A path that raises is reported to ``on_error(name, traceback)``,
    timed as None and not built again (every rank must fail alike: the
    callables are collectives). ``after_each(name, ms)`` follows every
    measurement (progress bars)."""
    times: dict[str, list[float]] = {name: [] for name in builders}
    failed: set[str] = set()
    for order in alternating_order(list(builders), rounds):
        for name in order:
            if name in failed:
                continue
            ms = None
            held = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            try:
                fn = builders[name]()
                ms = time_ms(fn, warmup, reps, group)
                times[name].append(ms)
            except Exception:  # noqa: BLE001 - one failing path must not hide the others
                failed.add(name)
                if on_error is not None:
                    on_error(name, traceback.format_exc())
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                if dist.is_available() and dist.is_initialized():
                    dist.barrier(group=group)
            fn = None
            if torch.cuda.is_available():
                if torch.cuda.memory_allocated() > held:
                    gc.collect()  # reference cycles (module hooks, autograd graphs) may still hold the path's tensors
                torch.cuda.empty_cache()
            if after_each is not None:
                after_each(name, ms)
    return {name: None if name in failed or not ts else statistics.median(ts) for name, ts in times.items()}
