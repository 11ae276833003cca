"""TorchTitan's trainer plus a loss file, on GPU or, without one, on CPU.

``./run_train.sh`` runs ``torchrun ... -m titan_uniep.torchtitan.train --job.config_file X``, which
runs ``main`` here on TorchTitan 0.2.2.
Training itself is ``torchtitan.train.main`` unchanged; this adds:

- ``titan_uniep.torchtitan.preflight`` before anything is built (a missing or broken
  config file, NGPU that does not fit the parallel degrees, ``[uniep]``
  errors), and relative bundled paths that work from any directory;
- the CPU shims (``titan_uniep.torchtitan.v0_2.cpu``) when CUDA is unavailable;
- offline mode for the Hugging Face libraries (the data is bundled);
- ``<job.dump_folder>/loss.jsonl``, written by rank 0: one line per logged step,
  ``{"step": N, "loss": L, "max_loss": M, "grad_norm": G, "time": T, ...}``,
  where L is the exact float TorchTitan prints with 5 decimals (global average
  loss over all valid tokens of the step), M the largest per-rank average, and
  T the seconds since the trainer finished building. Each line also carries
  the figures TorchTitan's ``MetricsProcessor.log`` computed for its step log
  line (the very values, see ``TORCHTITAN_METRICS``): ``tps`` (rank 0's
  tokens per second per device), ``tflops``, ``mfu_pct`` (MFU in percent of
  the peak TorchTitan assumes for the device), ``step_time`` (seconds per
  step since the previous logged step), ``mem_reserved_peak_gib`` (the
  "memory:" figure of the log line) and ``mem_active_peak_gib`` (rank 0's peak
  reserved and active bytes since the previous logged step, in GiB; without a
  GPU both are the process's peak resident set, from ``titan_uniep.torchtitan.v0_2.cpu``). On
  a GPU each line also has rank 0's ``mem_allocated`` (bytes held after the
  step) and ``mem_peak`` (peak allocated bytes since the previous logged step).
  ``python -m titan_uniep.tools.compare_loss RUN_A RUN_B`` compares two such files;
  ``python -m titan_uniep.tools.memory_flat RUN`` checks that memory stays flat;
  ``python -m titan_uniep.tools.bench_train`` takes its throughput figures from them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch
from torchtitan.components.metrics import BaseLogger
from torchtitan.config.manager import ConfigManager
from torchtitan.tools.logging import init_logger, logger
from torchtitan.train import Trainer, main as torchtitan_main

from titan_uniep.torchtitan.preflight import check_job, path_overrides
from titan_uniep.torchtitan.torchrun import exit_with_error
from titan_uniep.torchtitan.v0_2.cpu import CPU_ARGS, apply_cpu_shims, fp32_compute_args

LOSS_FILE = "loss.jsonl"

TORCHTITAN_METRICS = {
    "tps": "throughput(tps)",
    "tflops": "tflops",
    "mfu_pct": "mfu(%)",
    "step_time": "time_metrics/end_to_end(s)",
    "mem_reserved_peak_gib": "memory/max_reserved(GiB)",
    "mem_active_peak_gib": "memory/max_active(GiB)",
}
"""loss.jsonl field -> key of the metrics dict that TorchTitan 0.2.2's
``MetricsProcessor.log`` (components/metrics.py) builds for its step log line
and hands to its logger backend. A key it does not produce is left out."""


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


class LossRecordingTrainer(Trainer):
    """``Trainer`` whose metrics logging also appends to ``loss.jsonl`` on rank 0.

    It wraps ``metrics_processor.log`` on this one instance, the call where
    TorchTitan already holds the all-reduced loss as a Python float, so the
    recorded value is the logged one and training does no extra collective;
    its logger backend, wrapped too, hands over the throughput and memory
    figures that call computed.
    """

    def __init__(self, job_config):
        super().__init__(job_config)
        if torch.distributed.get_rank() != 0:
            return
        self._loss_path = os.path.join(job_config.job.dump_folder, LOSS_FILE)
        self._start = time.perf_counter()
        log = self.metrics_processor.log
        backend = self.metrics_processor.logger = _KeepLastMetrics(self.metrics_processor.logger)

        def log_and_record(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            memory = _memory()  # before log(), which resets the peak statistics
            backend.last = {}
            log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
            computed = {field: float(backend.last[key]) for field, key in TORCHTITAN_METRICS.items()
                        if key in backend.last}
            self._record(step, global_avg_loss, global_max_loss, grad_norm, {**computed, **memory})

        self.metrics_processor.log = log_and_record

    def train_step(self, data_iterator) -> None:
        # The trainer's step (restored from a checkpoint on resume) names the
        # step in guard messages and the test hooks.
        for model in self.model_parts:
            if getattr(model, "uniep_steps", None) is not None:
                model.uniep_steps.start_step(self.step)
        super().train_step(data_iterator)
        # UniEP's fused kernels record a failure on the device without a host sync:
        # every rank checks once a step, after the step's last kernel (on a logging
        # step TorchTitan has just synchronised for its loss; otherwise the next
        # step's first host-to-device copy would wait for the device anyway).
        op = sys.modules.get("titan_uniep.op")  # loaded by the kernel schedules only
        if op is not None:
            op.raise_pending_errors()

    def train(self) -> None:
        super().train()
        self._finished = True
        for model in self.model_parts:
            if getattr(model, "uniep_guard", None) is not None:
                model.uniep_guard.flush()  # the last check-mode verdicts

    def close(self) -> None:
        super().close()
        if getattr(self, "_finished", False) and not torch.cuda.is_available() and torch.distributed.is_initialized():
            # gloo, after a finished run only: ranks tear down together
            # (TorchTitan destroys the process group next); a rank whose peer
            # already closed its connections can abort (SIGABRT) in gloo. The
            # wait is bounded by the process group's timeout.
            torch.distributed.barrier()

    def _record(self, step: int, loss: float, max_loss: float, grad_norm: float, metrics: dict) -> None:
        # Step 1 starts a fresh file, so rerunning into the same dump folder
        # does not mix two runs; a run resumed from a checkpoint appends.
        mode = "w" if step == 1 else "a"
        os.makedirs(os.path.dirname(self._loss_path) or ".", exist_ok=True)
        line = {"step": step, "loss": float(loss), "max_loss": float(max_loss),
                "grad_norm": float(grad_norm), "time": round(time.perf_counter() - self._start, 4), **metrics}
        with open(self._loss_path, mode, encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def _memory() -> dict:
    if not torch.cuda.is_available():
        return {}
    return {"mem_allocated": torch.cuda.memory_allocated(), "mem_peak": torch.cuda.max_memory_allocated()}


def _drop_standard_moe_lines(record: logging.LogRecord) -> bool:
    # TorchTitan's build_moe logs "Standard MoE: ..." for every MoE block it builds; with
    # [uniep] enable the parallelize hook swaps each for UniEP's and logs that instead.
    return not str(record.msg).startswith("Standard MoE:")


def main() -> None:
    # Everything a run reads is local (bundled corpus and tokenizer); fail
    # instead of waiting on a network that training machines do not have.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:  # before TorchTitan builds anything: config file, keys, NGPU vs the degrees, [uniep]
        job_config = check_job(sys.argv[1:], world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as err:
        exit_with_error(str(err))
    ConfigManager.parse_args.__defaults__[0].extend(path_overrides(job_config))  # resolved paths (see below), last
    if getattr(job_config, "uniep", None) is not None and job_config.uniep.enable:
        logging.getLogger().addFilter(_drop_standard_moe_lines)
    if apply_cpu_shims():
        fp32 = fp32_compute_args()
        # TorchTitan 0.2.2's ConfigManager.parse_args(args=sys.argv[1:]) binds
        # its default when torchtitan is imported, so a change to sys.argv now
        # would not reach it: the overrides go into that default list itself,
        # ahead of the user's arguments (which still win).
        ConfigManager.parse_args.__defaults__[0][0:0] = CPU_ARGS + fp32
        if fp32:
            init_logger()  # torchtitan's main sets it up the same way again
            logger.info("UniEP: this CPU has no native bf16, so training computes in fp32 "
                        "(%s; add --training.mixed_precision_param bfloat16 to keep bf16)", " ".join(fp32))
    try:
        torchtitan_main(LossRecordingTrainer)
    except ValueError as err:
        # TorchTitan's and UniEP's configuration errors (validation raises ValueError with
        # the fix); TorchTitan's @record kept the traceback in the error file.
        exit_with_error(f"{type(err).__name__}: {err}")
    if not torch.cuda.is_available():
        # Training finished and the process group is gone; skip the C++ static
        # destructors, where gloo has aborted (SIGABRT) after a complete run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
