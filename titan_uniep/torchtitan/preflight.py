"""Checks of a training job that need no GPU and no process group, in two stages.

``check_launch(argv, world_size)`` needs the standard library only and takes
about 0.1 s: ``run_train.sh`` runs it before torchrun starts, as

    python3 -m titan_uniep.torchtitan.preflight NGPU --job.config_file FILE [overrides]

(it prints the job's dump folder, where run_train.sh puts torchrun's logs).
It checks

- TorchTitan is installed in a supported release (``titan_uniep.torchtitan.EDGES``);
- the config file (``--job.config_file``; ``CONFIG_FILE`` of run_train.sh)
  exists and is TOML (a syntax error is reported with its line and column),
  and it is a train config of the installed release (0.2.2: TorchTitan's TOML
  sections; 0.3.0: ``module`` and ``config`` with overrides, see
  ``titan_uniep.torchtitan.v0_3.toml``);
- every key of ``[uniep]``, in the file and on the command line
  (``--uniep.KEY``), is a key of the section (else the closest one is named),
  and the section's values pass its own checks (``titan_uniep.config.UniEP``);
- on TorchTitan 0.2.2, the world size (``NGPU`` of run_train.sh, torchrun's
  ``WORLD_SIZE``) fits the ``[parallelism]`` degrees of the file and the
  overrides, on the dense mesh and on the expert mesh alike (TorchTitan 0.2.2
  itself ends in an ``assert`` or in ``The product of mesh_sizes=(1, 1, 0, 2,
  1) is 0``). On 0.3.0 the degrees the file leaves out are its registry
  config's, which only TorchTitan reads.

``preflight(argv, world_size)`` is what the 0.2.2 edge's trainer
(``titan_uniep.torchtitan.v0_2.train``) runs in every worker before
TorchTitan builds anything (process group, device mesh,
model): ``check_launch`` again, then what needs TorchTitan (seconds of
imports, which is why run_train.sh does not wait for it): every key of every
section against TorchTitan's ``JobConfig`` with ``[uniep]`` merged, with the
closest key; TorchTitan's own parse of the file and the overrides; the world
size on what it parsed; with ``[uniep] enable = true`` the checks of
``titan_uniep.parallelize.validate`` that need only the config (the model's
MoE layers and the EP group's GPUs are checked in the parallelize hook) and
the tuning cache file (an unreadable or foreign file; a missing one is
fine: every shape then runs the defaults, with a warning). Every failure is a
``ValueError`` naming the key (or ``NGPU`` / ``CONFIG_FILE``) and the fix.

``preflight`` returns the CLI overrides that make the job's relative paths
work from any working directory: a relative ``model.hf_assets_path`` that
does not exist under the working directory is taken relative to the folder
that holds the ``titan_uniep`` package (the checkout, or site-packages), which
is where the bundled ``titan_uniep/assets/bpe2048`` of the train configs lives.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
from pathlib import Path
from types import SimpleNamespace

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from titan_uniep.config import UniEP
from titan_uniep.torchtitan import edge_module

__all__ = ["check_job", "check_keys", "check_launch", "check_world_size", "config_file_arg", "load_config_file",
           "path_overrides", "preflight"]

_CONFIG_FILE_FLAGS = ("--job.config_file", "--job.config-file")
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]
# TorchTitan 0.2.2's defaults (config/job_config.py; tests/test_preflight.py checks them against it).
_DEGREE_DEFAULTS = {
    "data_parallel_replicate_degree": 1,
    "data_parallel_shard_degree": -1,
    "context_parallel_degree": 1,
    "tensor_parallel_degree": 1,
    "pipeline_parallel_degree": 1,
    "expert_parallel_degree": 1,
    "expert_tensor_parallel_degree": 1,
}
_DUMP_FOLDER_DEFAULT = "./outputs"
_HELP_FLAGS = ("-h", "--help")


def config_file_arg(argv: list[str]) -> str | None:
    """The ``--job.config_file`` value in ``argv`` (``X`` or ``=X`` form), as TorchTitan finds it."""
    for i, arg in enumerate(argv):
        key, sep, value = arg.partition("=")
        if sep and key in _CONFIG_FILE_FLAGS:
            return value
        if arg in _CONFIG_FILE_FLAGS and i + 1 < len(argv):
            return argv[i + 1]
    return None


def without_config_file_arg(argv: list[str]) -> list[str]:
    """``argv`` without its ``--job.config_file`` argument (either form)."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.partition("=")[0] in _CONFIG_FILE_FLAGS and "=" in arg:
            continue
        if arg in _CONFIG_FILE_FLAGS and i + 1 < len(argv):
            skip = True
            continue
        out.append(arg)
    return out


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


# ---- keys ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Override:
    """One ``--section.key [value]`` of the command line, as tyro reads it."""

    path: tuple[str, ...]
    """The dotted key, hyphens read as underscores (``--uniep.guard-interval`` -> ("uniep", "guard_interval"))."""
    value: str | None
    """The text after ``=`` or the next argument; None for a flag (``--compile.enable``)."""
    flag: str
    """The argument as given, for messages."""


def cli_overrides(argv: list[str]) -> list[Override]:
    """The ``--section.key`` arguments of ``argv``. A value is the text after ``=`` or
    the next argument unless that starts with ``--`` (tyro's bool flags take none)."""
    overrides = []
    for i, arg in enumerate(argv):
        if not arg.startswith("--") or "." not in arg.partition("=")[0]:
            continue
        flag, sep, value = arg.partition("=")
        if not sep:
            following = argv[i + 1] if i + 1 < len(argv) else None
            value = None if following is None or following.startswith("--") else following
        path = tuple(part.replace("-", "_") for part in flag[2:].split("."))
        overrides.append(Override(path, value, flag))
    return overrides


def _field_types(cls) -> dict[str, object]:
    # The field types themselves, as TorchTitan's own TOML-to-dataclass step reads them.
    return {f.name: f.type for f in dataclasses.fields(cls)}


def _closest(key: str, choices) -> str | None:
    match = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return match[0] if match else None


def _bool_flag_field(key: str, types: dict) -> bool:
    # tyro spells a bool field's false flag --section.no-key / --section.no_key.
    return key.startswith("no_") and types.get(key[3:]) is bool


def check_keys(toml: dict, overrides: list[Override], sections: dict[str, type], *, all_sections: bool,
               config_path: str | None) -> None:
    """Raise ValueError for a key of ``sections`` (section name -> its dataclass)
    that the file or the command line names and the dataclass does not have,
    naming the closest key. ``all_sections``: ``sections`` is the whole config,
    so an unknown section is an error too; otherwise other sections are not looked at."""
    in_file = f"config file {config_path!r}: " if config_path else ""

    def walk(table: dict, cls, prefix: tuple[str, ...]) -> None:
        types = _field_types(cls)
        for key, value in table.items():
            if key not in types:
                raise ValueError(in_file + _unknown_key(key, ".".join(prefix), types, cli=False))
            if dataclasses.is_dataclass(types[key]) and isinstance(value, dict):
                walk(value, types[key], (*prefix, key))

    for name, table in toml.items():
        if name in sections and isinstance(table, dict):
            walk(table, sections[name], (name,))
        elif name not in sections and all_sections:
            raise ValueError(in_file + _unknown_key(name, "", sections, cli=False))
    for override in overrides:
        section, *keys = override.path
        if section not in sections:
            if all_sections:
                raise ValueError(_unknown_key(section, "", sections, cli=True))
            continue
        cls, prefix = sections[section], (section,)
        for key in keys:
            types = _field_types(cls)
            if key not in types and not _bool_flag_field(key, types):
                raise ValueError(_unknown_key(key, ".".join(prefix), types, cli=True))
            cls, prefix = types.get(key), (*prefix, key)
            if not dataclasses.is_dataclass(cls):
                break


def _unknown_key(key: str, section: str, known, *, cli: bool) -> str:
    """``KEY is not a key of [SECTION]; did you mean ...? The fix (the keys).`` (section "": a section name)."""
    hint = _closest(key, known)
    keys = ", ".join(known)
    if not section:
        spelt = (lambda k: f"--{k}.*") if cli else (lambda k: f"[{k}]")
        return (f"{spelt(key)} is not a section of the train config"
                + (f"; did you mean {spelt(hint)}?" if hint else ".")
                + f" Fix the {'override' if cli else 'section name in the file'} (the sections: {keys}).")
    spelt = (lambda k: f"--{section}.{k}") if cli else (lambda k: k)
    return (f"{spelt(key)} is not a key of [{section}]"
            + (f"; did you mean {spelt(hint)}?" if hint else ".")
            + f" Fix the {'override' if cli else 'key in the file'} (the keys of [{section}]: {keys}).")


def _cli_value(override: Override, key: str, hint) -> object:
    """The override's value as the field's type, or raise TypeError where tyro, not us, should judge it."""
    if hint is bool:
        if override.value is not None:
            raise TypeError("tyro's bool flags take no value")
        return not key.startswith("no_")
    if override.value is None:
        raise TypeError("no value")
    if hint is int:
        return int(override.value)
    if hint is float:
        return float(override.value)
    return override.value


def uniep_section(toml: dict, overrides: list[Override]) -> UniEP:
    """The ``[uniep]`` section of the file with the command line's values over it, checked
    by ``UniEP``'s own validation (ValueError naming the key). Overrides whose text
    cannot be read as the field's type are left to TorchTitan's parse."""
    values = dict(toml.get("uniep", {}))
    types = _field_types(UniEP)
    for override in overrides:
        if override.path[0] != "uniep" or len(override.path) != 2:
            continue
        key = override.path[1]
        field_name = key[3:] if _bool_flag_field(key, types) else key
        try:
            values[field_name] = _cli_value(override, key, types[field_name])
        except (TypeError, ValueError):
            continue
    return UniEP(**values)


# ---- world size ---------------------------------------------------------------------------


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
    values = {name: getattr(parallelism, name) for name in _DEGREE_DEFAULTS}
    for name, value in values.items():
        low = -1 if name == "data_parallel_shard_degree" else 1
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != low):
            allowed = "-1 (the ranks left over) or >= 1" if low == -1 else ">= 1"
            raise ValueError(f"parallelism.{name} = {value!r} must be {allowed}.")
    rep, shard, cp, tp, pp, ep, etp = values.values()
    # Only the degrees that differ from TorchTitan's defaults: the seven of them made a
    # 400-character line that hid the one that mattered.
    changed = [f"{name} = {value}" for name, value in values.items() if value != _DEGREE_DEFAULTS[name]]
    stated = ", ".join(changed) + ", the others at their defaults" if changed else "all at their defaults"
    launched = f"NGPU (WORLD_SIZE) = {world_size} does not fit the [parallelism] degrees ({stated}): "
    per_shard = rep * cp * tp * pp  # ranks per unit of data_parallel_shard_degree
    expert = ep * etp
    if shard == -1:
        # Valid world sizes: per_shard * s with ep * etp dividing s * cp * tp.
        step = rep * pp * math.lcm(cp * tp, expert)
        fix = f"Launch with NGPU = {step} or a multiple of it, or change the [parallelism] degrees."
        if world_size % per_shard:
            raise ValueError(
                f"{launched}data_parallel_replicate x context_parallel x tensor_parallel x pipeline_parallel "
                f"= {per_shard} does not divide {world_size}.\n{fix}"
            )
        shard = world_size // per_shard
    elif per_shard * shard != world_size:
        raise ValueError(
            f"{launched}their product is {per_shard * shard}.\nLaunch with NGPU = {per_shard * shard}, or set "
            "parallelism.data_parallel_shard_degree = -1 to use every rank."
        )
    else:
        fix = "Change the [parallelism] degrees (data_parallel_shard_degree = -1 takes the ranks left over)."
    if (shard * cp * tp) % expert:
        raise ValueError(
            f"{launched}the expert mesh needs expert_parallel x expert_tensor_parallel = {expert} to divide "
            f"data_parallel_shard x context_parallel x tensor_parallel = {shard * cp * tp}.\n{fix}"
        )
    return SimpleNamespace(dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, pp=pp, ep=ep, etp=etp,
                           world_size=world_size)


def _launch_degrees(toml: dict, overrides: list[Override]) -> SimpleNamespace | None:
    """The ``[parallelism]`` degrees of the file and the overrides (None if an override is not
    an integer: TorchTitan's parse reports that)."""
    degrees = dict(_DEGREE_DEFAULTS)
    degrees.update({k: v for k, v in toml.get("parallelism", {}).items() if k in degrees})
    for override in overrides:
        if override.path[:1] == ("parallelism",) and override.path[1:2] and override.path[1] in degrees:
            try:
                degrees[override.path[1]] = int(override.value)
            except (TypeError, ValueError):
                return None
    return SimpleNamespace(**degrees)


def _dump_folder(toml: dict, overrides: list[Override]) -> str:
    folder = toml.get("job", {}).get("dump_folder", _DUMP_FOLDER_DEFAULT)
    for override in overrides:
        if override.path == ("job", "dump_folder") and override.value is not None:
            folder = override.value
    return folder


# ---- the two stages -----------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    """What ``check_launch`` read: the config file's path and contents, the overrides."""

    config_path: str | None
    toml: dict
    overrides: list[Override]
    dump_folder: str
    """``job.dump_folder`` of the file and the overrides (TorchTitan's default ``./outputs``)."""


def _registry_dump_folder(toml: dict, argv: list[str]) -> str:
    # TorchTitan 0.3.0: dump_folder is a top-level field (--dump_folder / --dump-folder).
    folder = toml.get("dump_folder", _DUMP_FOLDER_DEFAULT)
    for i, arg in enumerate(argv):
        flag, sep, value = arg.partition("=")
        if flag in ("--dump_folder", "--dump-folder"):
            folder = value if sep else (argv[i + 1] if i + 1 < len(argv) else folder)
    return folder


def check_toml_release(path: str | None, toml: dict, edge: str) -> None:
    """Raise ValueError if the file is a train config of the other TorchTitan release than
    the installed one (``edge``: ``titan_uniep.torchtitan.edge_module()``), naming both."""
    if path is None:
        return
    registry_form = "module" in toml or "config" in toml
    if edge.endswith("v0_3") and not registry_form:
        raise ValueError(
            f"config file {path!r} is a TorchTitan 0.2.2 train config (it names no module and config), and "
            "TorchTitan 0.3.0 is installed. Use a 0.3.0 train config, e.g. "
            "CONFIG_FILE=train_configs/torchtitan_0_3/deepseek_v3_debug_uniep.toml (top-level module = ... and "
            "config = ..., then overrides), or install torchtitan==0.2.2."
        )
    if edge.endswith("v0_2") and registry_form:
        raise ValueError(
            f"config file {path!r} is a TorchTitan 0.3.0 train config (it names a module and config), and "
            "TorchTitan 0.2.2 is installed. Use a 0.2.2 train config, e.g. "
            "CONFIG_FILE=train_configs/deepseek_v3_debug_uniep.toml, or install torchtitan==0.3.0."
        )


def check_launch(argv: list[str], world_size: int) -> Launch:
    """The standard-library checks (see the module docstring); ValueError naming the key and the fix."""
    try:
        edge = edge_module()
    except RuntimeError as err:
        raise ValueError(str(err)) from None
    path = config_file_arg(argv)
    toml = load_config_file(path) if path is not None else {}
    overrides = cli_overrides(argv)
    registry_form = edge.endswith("v0_3")
    folder = _registry_dump_folder(toml, argv) if registry_form else _dump_folder(toml, overrides)
    launch = Launch(path, toml, overrides, folder)
    if any(arg in _HELP_FLAGS for arg in argv):
        return launch  # TorchTitan prints every key and exits
    check_toml_release(path, toml, edge)
    check_keys(toml, overrides, {"uniep": UniEP}, all_sections=False, config_path=path)
    if "uniep" in toml or any(o.path[0] == "uniep" for o in overrides):
        uniep_section(toml, overrides)
    if registry_form:
        return launch  # the degrees' defaults are the registry config's: TorchTitan checks them
    degrees = _launch_degrees(toml, overrides)
    if degrees is not None:
        check_world_size(degrees, world_size)
    return launch


def check_job(argv: list[str], world_size: int):
    """Every check (see the module docstring); returns TorchTitan's parsed ``JobConfig``.

    Args:
        argv: the trainer's command line (``sys.argv[1:]``: ``--job.config_file X`` and overrides).
        world_size: the number of ranks (torchrun's ``WORLD_SIZE``).
    Raises:
        ValueError: naming the key (or ``NGPU`` / ``CONFIG_FILE``) and the fix.
    """
    launch = check_launch(argv, world_size)
    from torchtitan.config import ConfigManager

    manager = ConfigManager()
    if not any(arg in _HELP_FLAGS for arg in argv):
        # TorchTitan's own resolution of [job] custom_config_module (the class its parse fills),
        # so the [uniep] section and any other merged one count as known.
        config_cls = manager._maybe_add_custom_config(list(argv), launch.toml)
        check_keys(launch.toml, launch.overrides, _field_types(config_cls), all_sections=True,
                   config_path=launch.config_path)
    # TorchTitan's own parse, which follows, logs the config's warnings (e.g. a
    # missing hf_assets_path, resolved below); this one stays quiet.
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        job_config = manager.parse_args(list(argv))  # the [uniep] section checks itself here
    finally:
        logging.disable(disabled)
    dims = check_world_size(job_config.parallelism, world_size)
    cfg = getattr(job_config, "uniep", None)
    if cfg is not None and cfg.enable:
        from titan_uniep.parallelize import validate

        validate(cfg, None, dims, job_config)
        if cfg.tuning != "off":
            from titan_uniep.tuning.selection import TuningPolicy

            TuningPolicy.from_config(cfg.tuning, cfg.tuning_cache)  # an unreadable or foreign file raises
    return job_config


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
    """``check_job``; returns the path overrides to add to the arguments."""
    return path_overrides(check_job(argv, world_size))


def main(argv: list[str]) -> int:
    """``preflight.py NGPU [trainer arguments]``: ``check_launch``; print the dump folder."""
    import sys

    try:
        world_size = int(argv[0])
    except (IndexError, ValueError):
        print(f"run_train.sh: NGPU={argv[0] if argv else ''!r} must be a positive integer (processes to launch), "
              "e.g. NGPU=2", file=sys.stderr)
        return 2
    if world_size < 1:
        print(f"run_train.sh: NGPU={world_size} must be at least 1 (processes to launch), e.g. NGPU=2",
              file=sys.stderr)
        return 2
    try:
        launch = check_launch(argv[1:], world_size)
    except ValueError as err:
        print(f"run_train.sh: {err}", file=sys.stderr)
        return 2
    print(launch.dump_folder)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
