"""TorchTitan's trainer plus a loss file, on GPU or, without one, on CPU.

``./run_train.sh`` runs ``torchrun ... -m titan_uniep.torchtitan.train --job.config_file X``, which
runs ``main`` here on TorchTitan 0.2.2.
Training itself is ``torchtitan.train.main`` unchanged; this adds:

- ``titan_uniep.torchtitan.preflight`` before anything is built (a missing or broken
  config file, NGPU that does not fit the parallel degrees, ``[uniep]``
  errors, a job UniEP cannot serve), and relative bundled paths that work from
  any directory (``titan_uniep.torchtitan.v0_2.preflight``);
- the CPU shims (``titan_uniep.torchtitan.v0_2.cpu``) when CUDA is unavailable;
- offline mode for the Hugging Face libraries (the data is bundled);
- ``<job.dump_folder>/loss.jsonl``, written by rank 0 (``titan_uniep.torchtitan.loss_file``).
"""

from __future__ import annotations

import logging
import os
import sys

import torch
from torchtitan.config.manager import ConfigManager
from torchtitan.tools.logging import init_logger, logger
from torchtitan.train import Trainer, main as torchtitan_main

from titan_uniep.torchtitan.loss_file import record_losses
from titan_uniep.torchtitan.preflight import check_job
from titan_uniep.torchtitan.torchrun import exit_with_error
from titan_uniep.torchtitan.trainer import UniEPSteps
from titan_uniep.torchtitan.v0_2.cpu import CPU_ARGS, apply_cpu_shims, fp32_compute_args
from titan_uniep.torchtitan.v0_2.preflight import path_overrides


class LossRecordingTrainer(UniEPSteps, Trainer):
    """TorchTitan 0.2.2's ``Trainer`` with UniEP's per-step work (``UniEPSteps``) and,
    on rank 0, ``loss.jsonl`` (``titan_uniep.torchtitan.loss_file``)."""

    def __init__(self, job_config):
        super().__init__(job_config)
        if torch.distributed.get_rank() == 0:
            record_losses(self.metrics_processor, job_config.job.dump_folder)


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
