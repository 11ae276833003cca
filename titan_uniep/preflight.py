"""Checks of a training job that need no GPU and no process group.

``titan_uniep.train.main`` runs ``preflight(argv, world_size)`` before
TorchTitan builds anything (process group, device mesh, model), so a job that
cannot run fails in seconds with a ``ValueError`` naming the key and the fix
instead of deep inside TorchTitan:

- the config file (``--job.config_file``; ``CONFIG_FILE`` of run_train.sh)
  exists and is TOML (a syntax error is reported with its line and column);
- the world size (``NGPU`` of run_train.sh, torchrun's ``WORLD_SIZE``) fits
  the ``[parallelism]`` degrees of the config and the CLI overrides, on the
  dense mesh and on the expert mesh alike (TorchTitan 0.2.2 itself ends in an
  ``assert`` or in ``The product of mesh_sizes=(1, 1, 0, 2, 1) is 0``);
- with ``[uniep] enable = true``: the checks of
  ``titan_uniep.parallelize.validate`` that need only the config (the model's
  MoE layers and the EP group's GPUs are checked in the parallelize hook).

``python3 titan_uniep/preflight.py FILE`` (run_train.sh) checks only the config file,
in milliseconds: this module imports nothing but the standard library at the top.

It returns the CLI overrides that make the job's relative paths work from any
working directory: a relative ``model.hf_assets_path`` that does not exist
under the working directory is taken relative to the folder that holds the
``titan_uniep`` package (the checkout, or site-packages), which is where the
bundled ``titan_uniep/assets/bpe2048`` of the train configs lives.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from types import SimpleNamespace

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["check_world_size", "config_file_arg", "load_config_file", "path_overrides", "preflight"]

_CONFIG_FILE_FLAGS = ("--job.config_file", "--job.config-file")
_PACKAGE_PARENT = Path(__file__).resolve().parents[1]


def config_file_arg(argv: list[str]) -> str | None:
    """The ``--job.config_file`` value in ``argv`` (``X`` or ``=X`` form), as TorchTitan finds it."""
    for i, arg in enumerate(argv):
        key, sep, value = arg.partition("=")
        if sep and key in _CONFIG_FILE_FLAGS:
            return value
        if arg in _CONFIG_FILE_FLAGS and i + 1 < len(argv):
            return argv[i + 1]
    return None


def load_config_file(path: str) -> dict:
    """Parse the TOML train config; ``ValueError`` naming the file and the fix if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(
            f"config file {path!r} (--job.config_file, CONFIG_FILE of run_train.sh) does not exist "
            f"(working directory {os.getcwd()}). Pass the path of a train config, e.g. "
            "CONFIG_FILE=train_configs/deepseek_v3_debug_uniep.toml."
        ) from None
    except IsADirectoryError:
        raise ValueError(
            f"config file {path!r} (--job.config_file, CONFIG_FILE of run_train.sh) is a directory; "
            "pass the path of a .toml train config."
        ) from None
    except tomllib.TOMLDecodeError as err:
        # The message ends with "(at line L, column C)" on every Python and tomli version.
        raise ValueError(f"config file {path!r} is not valid TOML: {err}. Fix that line of the file.") from None


_DEGREES = (
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "context_parallel_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "expert_parallel_degree",
    "expert_tensor_parallel_degree",
)


def check_world_size(parallelism, world_size: int) -> SimpleNamespace:
    """Check that ``world_size`` ranks fit the ``[parallelism]`` degrees; return the resolved degrees.

    TorchTitan 0.2.2 lays the ranks out as ``pp x dp_replicate x dp_shard x cp x tp``
    (dense) and ``pp x dp_replicate x efsdp x ep x etp`` (experts), with
    ``dp_shard = -1`` taking the ranks left over and ``efsdp = dp_shard * cp * tp / (ep * etp)``.
    So ``world_size = pp * dp_replicate * dp_shard * cp * tp`` and ``ep * etp`` must
    divide ``dp_shard * cp * tp``.

    Returns:
        ``dp_replicate, dp_shard, cp, tp, pp, ep, etp, world_size`` (``dp_shard``
        resolved), the fields of ``torchtitan.distributed.ParallelDims`` that
        validation reads, without building a mesh.
    """
    values = {name: getattr(parallelism, name) for name in _DEGREES}
    for name, value in values.items():
        low = -1 if name == "data_parallel_shard_degree" else 1
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != low):
            allowed = "-1 (the ranks left over) or >= 1" if low == -1 else ">= 1"
            raise ValueError(f"parallelism.{name} = {value!r} must be {allowed}.")
    rep, shard, cp, tp, pp, ep, etp = values.values()
    stated = ", ".join(f"{name} = {value}" for name, value in values.items())
    launched = f"NGPU (WORLD_SIZE) = {world_size} does not match the [parallelism] degrees ({stated}): "
    per_shard = rep * cp * tp * pp  # ranks per unit of data_parallel_shard_degree
    expert = ep * etp
    if shard == -1:
        # Valid world sizes: per_shard * s with ep * etp dividing s * cp * tp.
        step = rep * pp * math.lcm(cp * tp, expert)
        fix = f"Launch with NGPU = {step} or a multiple of it, or change the [parallelism] degrees."
        if world_size % per_shard:
            raise ValueError(
                f"{launched}data_parallel_replicate x context_parallel x tensor_parallel x pipeline_parallel "
                f"= {per_shard} does not divide {world_size}. {fix}"
            )
        shard = world_size // per_shard
    elif per_shard * shard != world_size:
        raise ValueError(
            f"{launched}their product is {per_shard * shard}. Launch with NGPU = {per_shard * shard}, or set "
            "parallelism.data_parallel_shard_degree = -1 to use every rank."
        )
    else:
        fix = "Change the [parallelism] degrees (data_parallel_shard_degree = -1 takes the ranks left over)."
    if (shard * cp * tp) % expert:
        raise ValueError(
            f"{launched}the expert mesh needs expert_parallel x expert_tensor_parallel = {expert} to divide "
            f"data_parallel_shard x context_parallel x tensor_parallel = {shard * cp * tp}. {fix}"
        )
    return SimpleNamespace(dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, pp=pp, ep=ep, etp=etp,
                           world_size=world_size)


def path_overrides(job_config) -> list[str]:
    """CLI overrides that resolve the job's relative bundled paths (see the module docstring)."""
    assets = job_config.model.hf_assets_path
    if not assets or os.path.isabs(assets) or os.path.exists(assets):
        return []
    bundled = _PACKAGE_PARENT / assets
    if not bundled.exists():
        return []  # TorchTitan's own error names the missing path
    return ["--model.hf_assets_path", str(bundled)]


def preflight(argv: list[str], world_size: int) -> list[str]:
    """Run every check on the trainer's arguments; return the path overrides to add to them.

    Args:
        argv: the trainer's command line (``sys.argv[1:]``: ``--job.config_file X`` and overrides).
        world_size: the number of ranks (torchrun's ``WORLD_SIZE``).
    Raises:
        ValueError: naming the key (or ``NGPU`` / ``CONFIG_FILE``) and the fix.
    """
    path = config_file_arg(argv)
    if path is not None:
        load_config_file(path)
    from torchtitan.config import ConfigManager

    # TorchTitan's own parse, which follows, logs the config's warnings (e.g. a
    # missing hf_assets_path, resolved below); this one stays quiet.
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        job_config = ConfigManager().parse_args(list(argv))  # the [uniep] section checks itself here
    finally:
        logging.disable(disabled)
    dims = check_world_size(job_config.parallelism, world_size)
    cfg = getattr(job_config, "uniep", None)
    if cfg is not None and cfg.enable:
        from titan_uniep.parallelize import validate

        validate(cfg, None, dims, job_config)
    return path_overrides(job_config)


if __name__ == "__main__":
    # run_train.sh checks CONFIG_FILE with ``python3 titan_uniep/preflight.py FILE`` before
    # torchrun starts: as a script this module needs the standard library only (importing the
    # package would load TorchTitan, seconds of start-up).
    import sys

    try:
        load_config_file(sys.argv[1])
    except ValueError as err:
        sys.exit(f"run_train.sh: {err}")
