"""``<dump_folder>/loss.jsonl``: every logged step's exact loss and TorchTitan's own figures.

Written by rank 0 of a run of either edge's trainer, one line per logged step
(a run resumed into the same dump folder replaces the records of the steps it
trains again, so a step has one line):
``{"step": N, "loss": L, "max_loss": M, "grad_norm": G, "time": T, ...}``,
where L is the exact float TorchTitan prints with 5 decimals (global average
loss over all valid tokens of the step), M the largest per-rank average, and
T the seconds since the trainer finished building. Each line also carries the
figures TorchTitan's ``MetricsProcessor.log`` computed for its step log line
(the very values, see ``TORCHTITAN_METRICS``): ``tps`` (rank 0's tokens per
second per device), ``tflops``, ``mfu_pct`` (MFU in percent of the peak
TorchTitan assumes for the device), ``step_time`` (seconds per step since
the previous logged step), ``mem_reserved_peak_gib`` (the "memory:" figure of
the log line) and ``mem_active_peak_gib`` (rank 0's peak reserved and active
bytes since the previous logged step, in GiB; without a GPU both are the
process's peak resident set, from the edge's CPU shims). On a GPU each line
also has rank 0's ``mem_allocated`` (bytes held after the step),
``mem_peak`` (peak allocated bytes since the previous logged step) and
``mem_symmetric`` (bytes of symmetric memory UniEP's workspaces hold:
PyTorch maps them outside its caching allocator, so the reserved figures
leave them out; 0 in a run without UniEP's kernels) and ``mem_device_used``
(the device's used bytes after the step, ``torch.cuda.mem_get_info``: every
process's allocations on it, the CUDA context, NCCL's and symmetric memory
included; the caching allocator keeps its segments, so after a step it is
about the reserved peak plus what lies outside it).

``python -m titan_uniep.tools.compare_loss RUN_A RUN_B`` compares two such
files; ``python -m titan_uniep.tools.memory_flat RUN`` checks that memory
stays flat; ``python -m titan_uniep.tools.bench_train`` takes its throughput
figures from them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch
from torchtitan.components.metrics import BaseLogger

__all__ = ["LOSS_FILE", "TORCHTITAN_METRICS", "keep_steps_before", "record_losses"]

logger = logging.getLogger(__name__)

LOSS_FILE = "loss.jsonl"

TORCHTITAN_METRICS = {
    "tps": "throughput(tps)",
    "tflops": "tflops",
    "mfu_pct": "mfu(%)",
    "step_time": "time_metrics/end_to_end(s)",
    "mem_reserved_peak_gib": "memory/max_reserved(GiB)",
    "mem_active_peak_gib": "memory/max_active(GiB)",
}
"""loss.jsonl field -> key of the metrics dict that TorchTitan's
``MetricsProcessor.log`` (components/metrics.py, the same keys in 0.2.2 and
0.3.0) builds for its step log line and hands to its logger backend. A key it
does not produce is left out."""


class _KeepLastMetrics(BaseLogger):
    """A metrics-logger backend that keeps the last metrics dict and passes it on.

    ``MetricsProcessor.log`` computes tps, MFU and the memory peaks, gives
    them to its backend (TensorBoard, W&B, or none) and prints them; it
    returns nothing. Standing in for the backend reads exactly those values
    instead of recomputing them differently.
    """

    def __init__(self, backend: BaseLogger):
        self.backend = backend
        self.last: dict = {}

    def log(self, metrics: dict, step: int) -> None:
        self.last = metrics
        self.backend.log(metrics, step)

    def close(self) -> None:
        self.backend.close()


def _memory() -> dict:
    if not torch.cuda.is_available():
        return {}
    op = sys.modules.get("titan_uniep.op")  # loaded where a UniEP kernel schedule runs
    free, total = torch.cuda.mem_get_info()
    return {"mem_allocated": torch.cuda.memory_allocated(), "mem_peak": torch.cuda.max_memory_allocated(),
            "mem_symmetric": op.symmetric_memory_bytes() if op is not None else 0, "mem_device_used": total - free}


def keep_steps_before(path: str, first_step: int) -> tuple[int, int]:
    """Rewrite the loss file at ``path`` with one record of each step before
    ``first_step``, the first step a run will train; return how many records it
    kept and how many it dropped.

    A run resumed from a checkpoint at step S trains steps S+1 on again: the
    records the earlier run wrote of those steps (and any line cut short where
    it was killed mid-write) go, so the file keeps one record per step. Of a
    step recorded more than once (a file an earlier version appended a resumed
    run to) the last record stays, the resumed run's. A fresh run
    (``first_step`` 1) starts an empty file. The file is replaced whole (a
    partial file renamed into place), so a run killed meanwhile leaves the old
    file or the new one."""
    kept, records = {}, 0
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):  # a line cut short by a kill: not a record
                    continue
                records += 1
                if step < first_step:
                    kept[step] = line if line.endswith("\n") else line + "\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.writelines(kept[step] for step in sorted(kept))
    os.replace(partial, path)
    return len(kept), records - len(kept)


def record_losses(metrics_processor, dump_folder: str) -> None:
    """Make ``metrics_processor`` (a built trainer's) also append every logged step to
    ``<dump_folder>/loss.jsonl``; call it on rank 0 only.

    It wraps ``metrics_processor.log`` on this one instance, the call where
    TorchTitan already holds the all-reduced loss as a Python float, so the
    recorded value is the logged one and training does no extra collective;
    its logger backend, wrapped too, hands over the throughput and memory
    figures that call computed. The file keeps one record per step: the
    trainer asks ``metrics_processor.should_log(step)`` after every step it
    trains (0.2.2 and 0.3.0), so its first call names the first step this run
    trains, after any checkpoint was loaded; the records of that step and later
    ones go then (``keep_steps_before``): rerunning into the same dump folder
    starts a fresh file, and a run resumed from a checkpoint at step S replaces
    the earlier run's records of steps S+1 on.
    """
    path = os.path.join(dump_folder, LOSS_FILE)
    start = time.perf_counter()
    log, should_log = metrics_processor.log, metrics_processor.should_log
    backend = metrics_processor.logger = _KeepLastMetrics(metrics_processor.logger)
    first_step = None

    def start_at_first_step(step: int) -> bool:
        nonlocal first_step
        if first_step is None:
            first_step = step
            kept, dropped = keep_steps_before(path, step)
            if step > 1 and (kept or dropped):  # a resumed run
                logger.info("UniEP: this run trains from step %d on: %s keeps %d records (one per earlier step) "
                            "and drops %d", step, path, kept, dropped)
        return should_log(step)

    def log_and_record(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        memory = _memory()  # before log(), which resets the peak statistics
        backend.last = {}
        log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
        computed = {field: float(backend.last[key]) for field, key in TORCHTITAN_METRICS.items()
                    if key in backend.last}
        line = {"step": step, "loss": float(global_avg_loss), "max_loss": float(global_max_loss),
                "grad_norm": float(grad_norm), "time": round(time.perf_counter() - start, 4), **computed, **memory}
        if first_step is None:  # a trainer that logged without asking should_log first
            start_at_first_step(step)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    metrics_processor.should_log = start_at_first_step
    metrics_processor.log = log_and_record
