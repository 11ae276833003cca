"""``run_train.sh``'s trainer on TorchTitan 0.3.0: TorchTitan's ``train.main`` with UniEP's start-up.

    torchrun ... -m titan_uniep.torchtitan.train --job.config_file FILE.toml [--section.key value ...]
    torchrun ... -m titan_uniep.torchtitan.train --module M --config C [--section.key value ...]

With ``--job.config_file`` (what ``run_train.sh`` passes), the TOML names the
module and config and holds overrides (``titan_uniep.torchtitan.v0_3.toml``);
without it the job is TorchTitan's own ``--module`` / ``--config``. Either way
the command line wins. Training is TorchTitan's: ``UniEPTrainer`` (the
configs of ``config_registry``) or any trainer the config builds. This adds:

- the TOML, read with tomllib and applied through TorchTitan's config manager
  (``preflight.parse_job``); its errors, TorchTitan's and UniEP's configuration
  errors end the worker with one line naming the key and the fix
  (``exit_with_error``);
- the CPU shims (``cpu``) when CUDA is unavailable;
- offline mode for the Hugging Face libraries (the data is bundled).
"""

from __future__ import annotations

import os
import sys

import torch

from titan_uniep.torchtitan.torchrun import exit_with_error
from titan_uniep.torchtitan.v0_3.cpu import CPU_ARGS, apply_cpu_shims, use_dense_mask_attention
from titan_uniep.torchtitan.v0_3.preflight import parse_job


def main() -> None:
    # Everything a run reads is local (bundled corpus and tokenizer); fail
    # instead of waiting on a network that training machines do not have.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from torchtitan.tools.logging import init_logger

    init_logger()
    argv = sys.argv[1:]
    cpu = apply_cpu_shims()
    if cpu:
        argv = CPU_ARGS + argv  # ahead of the user's arguments, which still win
    try:
        config = parse_job(argv)
    except (ValueError, ImportError) as err:
        exit_with_error(str(err))
    if cpu and config.model_spec is not None:
        use_dense_mask_attention(config.model_spec.model)
    trainer = None
    try:
        trainer = config.build()
        trainer.train()
    except ValueError as err:
        # TorchTitan's and UniEP's configuration errors (validation raises ValueError with the fix).
        if trainer is not None:
            trainer.close()
        exit_with_error(f"{type(err).__name__}: {err}")
    except Exception:
        if trainer is not None:
            trainer.close()
        raise
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if not torch.cuda.is_available():
        # Training finished and the process group is gone; skip the C++ static
        # destructors, where gloo has aborted (SIGABRT) after a complete run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
