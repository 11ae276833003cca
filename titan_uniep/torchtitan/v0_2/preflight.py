"""The TorchTitan 0.2.2 edge's start-up checks in the worker: what needs TorchTitan.

``titan_uniep.torchtitan.preflight.check_job`` runs ``check_job`` here after its
standard-library checks (``check_launch``), before TorchTitan builds anything
(process group, device mesh, model):

- every key of every section against TorchTitan's ``JobConfig`` with ``[job]
  custom_config_module`` merged (found by TorchTitan's own
  ``_maybe_add_custom_config``), naming the closest key;
- TorchTitan's own parse of the file and the overrides (the second parse of the
  process), and the world size on what it parsed;
- with ``[uniep] enable = true``: a ``*_uniep`` model (on the parsed name),
  the checks of ``parallelize.validate`` that need only the config (TP / ETP,
  the comm backend, a schedule this machine can run; the EP group's GPUs are
  checked in the parallelize hook), MoE layers in the model built on the meta
  device (``parallelize.check_moe_layers``), and the tuning cache file
  (an unreadable or foreign file; a missing one is fine: every shape then runs
  the defaults, with a warning).

``path_overrides`` makes the job's relative bundled paths work from any working
directory: a relative ``model.hf_assets_path`` that does not exist under the
working directory is taken relative to the folder that holds the
``titan_uniep`` package (the checkout, or site-packages), which is where the
bundled ``titan_uniep/assets/bpe2048`` of the train configs lives.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
from torchtitan.config import ConfigManager, JobConfig
from torchtitan.protocols.train_spec import get_train_spec

from titan_uniep.torchtitan.preflight import (Launch, check_keys, check_uniep_model, check_world_size, field_types,
                                              help_requested)
from titan_uniep.torchtitan.v0_2.parallelize import check_moe_layers, validate
from titan_uniep.tuning.selection import TuningPolicy

__all__ = ["check_job", "path_overrides"]

_PACKAGE_PARENT = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def _quiet_warnings() -> Iterator[None]:
    # TorchTitan's own parse and build, which follow, log the config's warnings (e.g. a missing
    # hf_assets_path, resolved by path_overrides) and a line per MoE block; these stay quiet.
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(disabled)


def _meta_model(job_config: JobConfig) -> nn.Module | None:
    """The job's model class built from its flavor's arguments on the meta device (no memory;
    0.1 s for DeepSeek-V3 671B on 2 cores), to see which of its blocks are MoE; None where the
    train spec or flavor is unknown (TorchTitan's own error names it)."""
    if job_config.experimental.custom_import:
        importlib.import_module(job_config.experimental.custom_import)  # as the trainer does, first
    try:
        spec = get_train_spec(job_config.model.name)
    except ValueError:
        return None
    args = spec.model_args.get(job_config.model.flavor)
    if args is None:
        return None
    args = copy.deepcopy(args)
    # Of what the trainer's update_from_config sets before it builds (sizes, kernels), deepseek_v3's
    # build reads only the comm backend (validate has made it "standard"); the rest is left out,
    # as it asks the GPU for its capability, which before the trainer sets each rank's device would
    # open a context on GPU 0 in every rank. None of it decides which blocks are MoE.
    args.moe_impl = job_config.parallelism.expert_parallel_comm_backend
    with _quiet_warnings(), torch.device("meta"):
        return spec.model_cls(args)


def check_job(launch: Launch, world_size: int) -> JobConfig:
    """The worker's checks that need TorchTitan (see the module docstring), after ``check_launch``.

    Args:
        launch: what ``check_launch`` read (the config file, the overrides, the command line).
        world_size: the number of ranks (torchrun's ``WORLD_SIZE``).
    Returns:
        TorchTitan's parsed ``JobConfig``.
    Raises:
        ValueError: naming the key (or ``NGPU``) and the fix.
    """
    argv = launch.argv
    manager = ConfigManager()
    if not help_requested(argv):
        # TorchTitan's own resolution of [job] custom_config_module (the class its parse fills),
        # so the [uniep] section and any other merged one count as known.
        config_cls = manager._maybe_add_custom_config(list(argv), launch.toml)
        check_keys(launch.toml, launch.overrides, field_types(config_cls), all_sections=True,
                   config_path=launch.config_path)
    with _quiet_warnings():
        job_config = manager.parse_args(list(argv))  # the [uniep] section checks itself here
    dims = check_world_size(job_config.parallelism, world_size)
    cfg = getattr(job_config, "uniep", None)
    if cfg is not None and cfg.enable:
        check_uniep_model(job_config.model.name, given_as=f"[model] name = {job_config.model.name!r}")
        validate(cfg, None, dims, job_config)
        model = _meta_model(job_config)
        if model is not None:
            check_moe_layers(model, job_config)
        if cfg.tuning != "off":
            TuningPolicy.from_config(cfg.tuning, cfg.tuning_cache)  # an unreadable or foreign file raises
    return job_config


def path_overrides(job_config: JobConfig) -> list[str]:
    """CLI overrides that resolve the job's relative bundled paths (see the module docstring)."""
    assets = job_config.model.hf_assets_path
    if not assets or os.path.isabs(assets) or os.path.exists(assets):
        return []
    bundled = _PACKAGE_PARENT / assets
    if not bundled.exists():
        return []  # TorchTitan's own error names the missing path
    return ["--model.hf_assets_path", str(bundled)]
