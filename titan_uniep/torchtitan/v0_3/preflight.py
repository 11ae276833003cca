"""The TorchTitan 0.3.0 edge's start-up checks: its config manager's parse of the job and UniEP's checks.

``parse_job(argv)`` is what the worker (``titan_uniep.torchtitan.v0_3.train``)
runs before TorchTitan builds anything: the TOML of ``--job.config_file`` (if
given; ``titan_uniep.torchtitan.v0_3.toml``, whose errors name the file's line)
and the command line, through TorchTitan's config manager, after the check that
UniEP's options are not set on a config of TorchTitan's own registries, which
has no ``uniep`` section (``titan_uniep.torchtitan.preflight.check_uniep_module``);
then ``UniEPTrainer``'s checks (``trainer.validate``).

``check_job`` and ``path_overrides`` are this edge's side of
``titan_uniep.torchtitan.preflight.check_job`` / ``preflight``, after its
standard-library checks.
"""

from __future__ import annotations

from titan_uniep.torchtitan.preflight import (Launch, check_uniep_module, config_file_arg, load_config_file,
                                              without_config_file_arg)

__all__ = ["check_job", "parse_job", "path_overrides"]


def parse_job(argv: list[str]):
    """The job's config: the TOML of ``--job.config_file`` (if given) and the command line,
    through TorchTitan's config manager. Raises ValueError naming the key and the fix."""
    # TorchTitan's config and trainer modules are imported at the first parse, after the
    # worker has set up logging and its CPU shims (train.main).
    from torchtitan.config import ConfigManager

    from titan_uniep.torchtitan.v0_3.toml import TomlConfigManager
    from titan_uniep.torchtitan.v0_3.trainer import UniEPTrainer, validate

    path = config_file_arg(argv)
    args = without_config_file_arg(argv)
    toml = load_config_file(path) if path is not None else {}
    check_uniep_module(toml, argv, config_path=path)
    if path is None:
        config = ConfigManager().parse_args(args)
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        config = TomlConfigManager(path, toml, text).parse_args(args)
    if isinstance(config, UniEPTrainer.Config):
        validate(config)
    return config


def check_job(launch: Launch, world_size: int):
    """``parse_job`` of the command line ``check_launch`` read; the world size is TorchTitan's to check."""
    return parse_job(launch.argv)


def path_overrides(config) -> list[str]:
    """None: the configs of ``config_registry`` name the bundled tokenizer by its absolute path
    (``titan_uniep.torchtitan.data.ASSETS_DIR``)."""
    return []
