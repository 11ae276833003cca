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
- every section of the file and of the command line (``--SECTION.key``) is a
  section of the release's config (else the closest one is named): on 0.2.2
  TorchTitan's ``JobConfig`` with ``[uniep]``, on 0.3.0 the config of
  ``titan_uniep.torchtitan.v0_3`` (``UniEPTrainer.Config``);
- every key of ``[uniep]``, in the file and on the command line
  (``--uniep.KEY``), is a key of the section (else the closest one is named),
  and the section's values pass its own checks (``titan_uniep.config.UniEP``);
- a job that sets ``[uniep]`` can be served by UniEP: on 0.2.2 ``[job]
  custom_config_module = "titan_uniep.config"`` (which adds the section) and,
  with ``enable = true``, a ``*_uniep`` model (TorchTitan's own models would
  train their own MoE); on 0.3.0 a config of ``titan_uniep.torchtitan.v0_3``,
  not one of TorchTitan's own registries (whose configs have no ``uniep``);
- on TorchTitan 0.2.2, the world size (``NGPU`` of run_train.sh, torchrun's
  ``WORLD_SIZE``) fits the ``[parallelism]`` degrees of the file and the
  overrides, on the dense mesh and on the expert mesh alike (TorchTitan 0.2.2
  itself ends in an ``assert`` or in ``The product of mesh_sizes=(1, 1, 0, 2,
  1) is 0``). On 0.3.0 the degrees the file leaves out are its registry
  config's, which only TorchTitan reads.

What the launcher reads of each release's train config is here, in the
standard library, not in the edges: importing ``titan_uniep.torchtitan.v0_2``
registers its train specs, which imports TorchTitan (25 s on 2 busy cores).

``check_job(argv, world_size)`` runs ``check_launch`` again, then the
installed edge's own checks, which need TorchTitan (seconds of imports, which
is why run_train.sh does not wait for them). Each edge has them in its
``preflight`` module, the same two functions, reached by name (this module
imports no edge and no hook):

- ``check_job(launch, world_size)``: the checks on TorchTitan's parse of the
  job; returns the parsed config. ``titan_uniep.torchtitan.v0_2.preflight``:
  every key of every section, the world size, UniEP's model, the checks of
  the hook's ``validate`` that need no GPU, MoE layers in the model built on
  the meta device, the tuning cache file. ``v0_3.preflight``: its
  ``parse_job`` (the TOML and the command line through TorchTitan's config
  manager, then ``UniEPTrainer``'s checks);
- ``path_overrides(config)``: CLI overrides that make the job's relative
  bundled paths work from any working directory.

The 0.2.2 edge's trainer (``titan_uniep.torchtitan.v0_2.train``) runs
``check_job`` in every worker before TorchTitan builds anything (process
group, device mesh, model); the 0.3.0 edge's (``v0_3.train``) runs
``parse_job``, whose TOML errors name the file's line. ``preflight(argv,
world_size)`` runs ``check_job`` and returns the edge's path overrides. Every
failure is a ``ValueError`` naming the key (or ``NGPU`` / ``CONFIG_FILE``)
and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import os
from types import SimpleNamespace

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from titan_uniep.config import UniEP
from titan_uniep.torchtitan import EDGES, edge_module

__all__ = ["UNIEP_MODELS", "Launch", "check_job", "check_keys", "check_launch", "check_section_names",
           "check_uniep_model", "check_uniep_module", "check_world_size", "config_file_arg", "field_types",
           "help_requested", "load_config_file", "preflight", "uniep_section"]

_CONFIG_FILE_FLAGS = ("--job.config_file", "--job.config-file")
_HELP_FLAGS = ("-h", "--help")

# TorchTitan 0.2.2's defaults and sections (config/job_config.py; tests/test_preflight.py checks them against it).
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
_MODEL_NAME_DEFAULT = "llama3"
_SECTIONS_0_2 = ("job", "profiling", "metrics", "model", "optimizer", "lr_scheduler", "training", "parallelism",
                 "checkpoint", "activation_checkpoint", "compile", "quantize", "comm", "memory_estimation",
                 "fault_tolerance", "experimental", "validation", "debug")
_UNIEP_CONFIG_MODULE = "titan_uniep.config"
"""``[job] custom_config_module`` that merges ``[uniep]`` into TorchTitan 0.2.2's ``JobConfig``."""

UNIEP_MODELS = {
    "deepseek_v3_uniep": "deepseek_v3",
    "qwen3_uniep": "qwen3",
    "llama4_uniep": "llama4",
}
"""TorchTitan 0.2.2's models with a UniEP variant: train spec name -> its base model.
``titan_uniep.torchtitan.v0_2`` registers them; the launcher checks ``[model] name`` against them."""

# TorchTitan 0.3.0: the fields of titan_uniep.torchtitan.v0_3's configs (UniEPTrainer.Config: Trainer.Config and
# uniep), tables and plain values, and TorchTitan's own config registries (--module shorthands, config/manager.py);
# tests/torchtitan_0_3/test_v0_3_edge.py checks them against it.
_UNIEP_MODULES_0_3 = ("titan_uniep.torchtitan.v0_3", "titan_uniep.torchtitan.v0_3.config_registry")
_SECTIONS_0_3 = ("profiler", "metrics", "tokenizer", "dataloader", "optimizer", "lr_scheduler", "training",
                 "parallelism", "checkpoint", "activation_checkpoint", "compile", "comm", "validator", "debug",
                 "override", "loss", "uniep")
_TOP_LEVEL_KEYS_0_3 = ("module", "config", "model_spec", "hf_assets_path", "dump_folder")
_TORCHTITAN_MODULES_0_3 = frozenset({
    "deepseek_v3", "flux", "gpt_oss", "kimi_k2_7", "llama3", "muse_glimmer", "qwen3", "qwen3_5",
    "alphabet_sort", "autoparallel.llama3", "autoparallel.local_map_deepseek_v3", "dapo_math",
    "graph_trainer.deepseek_v3", "graph_trainer.llama3", "graph_trainer.muse_glimmer", "graph_trainer.qwen3", "rl",
    "search_r1", "torchft.llama3", "transformers_modeling_backend",
})


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


def field_types(cls) -> dict[str, object]:
    """Field name -> its type, as TorchTitan's own TOML-to-dataclass step reads them."""
    return {f.name: f.type for f in dataclasses.fields(cls)}


def help_requested(argv: list[str]) -> bool:
    """Whether ``argv`` asks for TorchTitan's help (which prints every key and exits)."""
    return any(arg in _HELP_FLAGS for arg in argv)


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
        types = field_types(cls)
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
            types = field_types(cls)
            if key not in types and not _bool_flag_field(key, types):
                raise ValueError(_unknown_key(key, ".".join(prefix), types, cli=True))
            cls, prefix = types.get(key), (*prefix, key)
            if not dataclasses.is_dataclass(cls):
                break


def check_section_names(toml: dict, overrides: list[Override], sections, *, config_path: str | None,
                        tables_only: bool = False, also_known=()) -> None:
    """Raise ValueError for a section of the file or of an override (``--SECTION.key``) that is not
    one of ``sections``, naming the closest one. ``tables_only``: the file's top-level plain values
    are not looked at (they are fields of the config, not sections); ``also_known``: top-level names
    that are no section but are left to the config's own checks."""
    in_file = f"config file {config_path!r}: " if config_path else ""
    known = set(sections) | set(also_known)
    for name, value in toml.items():
        if name not in known and (isinstance(value, dict) or not tables_only):
            raise ValueError(in_file + _unknown_key(name, "", sections, cli=False))
    for override in overrides:
        if override.flag not in _CONFIG_FILE_FLAGS and override.path[0] not in known:
            raise ValueError(_unknown_key(override.path[0], "", sections, cli=True))


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
    types = field_types(UniEP)
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


# ---- whether UniEP can serve the job ---------------------------------------------------------


def _sets_uniep(toml: dict, overrides: list[Override]) -> bool:
    return "uniep" in toml or any(o.path[0] == "uniep" for o in overrides)


def check_uniep_model(model_name: str, *, given_as: str) -> None:
    """TorchTitan 0.2.2, ``[uniep] enable = true``: raise ValueError unless ``model_name`` is a
    ``*_uniep`` train spec, naming the fix. UniEP reaches the MoE blocks of those only; any other
    model trains TorchTitan's own MoE (or has none) with UniEP named in its config.
    ``given_as``: how the job names the model (``[model] name = 'x'``, ``--model.name x``)."""
    if model_name.endswith("_uniep"):
        return
    if model_name in UNIEP_MODELS.values():
        why = (f"is TorchTitan's own {model_name}, whose MoE blocks UniEP does not reach: the job would train "
               "TorchTitan's MoE")
        fix = (f"Set [model] name = \"{model_name}_uniep\" (--model.name {model_name}_uniep: the same model with "
               "UniEP's expert-parallel path)")
    else:
        hint = _closest(model_name, UNIEP_MODELS)
        why = "is not a model UniEP serves: it reaches the MoE blocks of the *_uniep models only"
        fix = ((f"Did you mean {hint}? " if hint else "") + "Set [model] name to one of them ("
               + ", ".join(f'"{m}"' for m in UNIEP_MODELS) + ": TorchTitan's " + ", ".join(UNIEP_MODELS.values())
               + " with UniEP's expert-parallel path)")
    raise ValueError(f"[uniep] enable = true, but {given_as} {why}. {fix}, or set [uniep] enable = false.")


def _launch_model_name(launch: "Launch") -> tuple[str, str]:
    """TorchTitan 0.2.2: ``[model] name`` of the overrides or the file, and how the job gives it."""
    for override in reversed(launch.overrides):
        if override.path == ("model", "name") and override.value is not None:
            return override.value, f"--model.name {override.value}"
    name = launch.toml.get("model", {}).get("name")
    if isinstance(name, str):
        return name, f"[model] name = {name!r}"
    return _MODEL_NAME_DEFAULT, f"[model] name (unset: TorchTitan's default {_MODEL_NAME_DEFAULT!r})"


def _custom_config_module(launch: "Launch") -> str | None:
    # As TorchTitan 0.2.2 finds it (ConfigManager._maybe_add_custom_config): the command line, then the file.
    argv = launch.argv
    for i, arg in enumerate(argv):
        flag, sep, value = arg.partition("=")
        if flag in ("--job.custom_config_module", "--job.custom-config-module"):
            return (value if sep else (argv[i + 1] if i + 1 < len(argv) else None)) or None
    return launch.toml.get("job", {}).get("custom_config_module") or None


def _registry_module(toml: dict, argv: list[str]) -> tuple[str | None, str]:
    """TorchTitan 0.3.0: the config registry the job names (``--module``, else the file's
    ``module``) and how it names it."""
    for i, arg in enumerate(argv):
        flag, sep, value = arg.partition("=")
        if flag == "--module":
            module = value if sep else (argv[i + 1] if i + 1 < len(argv) else None)
            return module, f"--module {module}"
    module = toml.get("module")
    return (module, f"module = {module!r}") if isinstance(module, str) else (None, "")


def check_uniep_module(toml: dict, argv: list[str], *, config_path: str | None) -> None:
    """TorchTitan 0.3.0: raise ValueError if the job sets UniEP's options (``[uniep]``,
    ``--uniep.*``) on a config of one of TorchTitan's own registries (``--module llama3``,
    ``torchtitan.models.qwen3``): their configs have no ``uniep`` section and train TorchTitan's
    MoE. A registry of neither TorchTitan nor titan_uniep is the worker's to judge
    (``titan_uniep.torchtitan.v0_3.toml`` refuses ``[uniep]`` on a config without the section)."""
    module, given_as = _registry_module(toml, argv)
    overrides = [o.flag for o in cli_overrides(argv) if o.path[0] == "uniep"]
    if module is None or not ("uniep" in toml or overrides):
        return
    if module not in _TORCHTITAN_MODULES_0_3 and module.split(".")[0] != "torchtitan":
        return
    options = "[uniep]" if "uniep" in toml else overrides[0]
    in_file = f"config file {config_path!r}: " if config_path else ""
    raise ValueError(
        f"{in_file}{given_as} is TorchTitan's own config registry, and the job sets {options}: TorchTitan's "
        "configs have no uniep section, so it would train TorchTitan's MoE without UniEP. Name a config of "
        "titan_uniep's registry, whose uniep section runs UniEP: module = \"titan_uniep.torchtitan.v0_3\" (--module "
        "titan_uniep.torchtitan.v0_3) and one of its configs (e.g. config = \"deepseek_v3_debug_uniep\"; "
        f"titan_uniep/torchtitan/v0_3/config_registry.py lists them), or remove {options}."
    )


# ---- the two stages -----------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    """What ``check_launch`` read: the config file's path and contents, the overrides."""

    config_path: str | None
    toml: dict
    overrides: list[Override]
    dump_folder: str
    """``job.dump_folder`` of the file and the overrides (TorchTitan's default ``./outputs``)."""
    argv: list[str]
    """The trainer's command line (``--job.config_file X`` and overrides), as given."""


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


def _check_uniep_section(launch: Launch) -> UniEP | None:
    """``[uniep]`` of the file and the overrides: its keys, then its values; None where the job sets none."""
    check_keys(launch.toml, launch.overrides, {"uniep": UniEP}, all_sections=False, config_path=launch.config_path)
    return uniep_section(launch.toml, launch.overrides) if _sets_uniep(launch.toml, launch.overrides) else None


def _check_launch_v0_2(launch: Launch, world_size: int) -> None:
    """TorchTitan 0.2.2's TOML: sections, ``[uniep]``, UniEP's model, the world size."""
    toml, overrides, path = launch.toml, launch.overrides, launch.config_path
    custom_module = _custom_config_module(launch)
    if _sets_uniep(toml, overrides) and custom_module is None:
        options = (f"config file {path!r} sets [uniep]" if "uniep" in toml
                   else f"{next(o.flag for o in overrides if o.path[0] == 'uniep')} is given")
        raise ValueError(
            f"{options}, but names no [job] custom_config_module: TorchTitan's job config has a [uniep] section "
            f"only with custom_config_module = \"{_UNIEP_CONFIG_MODULE}\". Add that line under [job] (or pass "
            f"--job.custom_config_module {_UNIEP_CONFIG_MODULE})."
        )
    if custom_module in (None, _UNIEP_CONFIG_MODULE):
        # Another custom_config_module adds sections only TorchTitan's import of it knows (check_job).
        sections = _SECTIONS_0_2 + (("uniep",) if custom_module else ())
        check_section_names(toml, overrides, sections, config_path=path)
    cfg = _check_uniep_section(launch)
    if cfg is not None and cfg.enable:
        name, given_as = _launch_model_name(launch)
        try:
            check_uniep_model(name, given_as=given_as)
        except ValueError as err:
            raise ValueError(f"config file {path!r}: {err}" if path else str(err)) from None
    degrees = _launch_degrees(toml, overrides)
    if degrees is not None:
        check_world_size(degrees, world_size)


def _check_launch_v0_3(launch: Launch, world_size: int) -> None:
    """TorchTitan 0.3.0's TOML form: sections, ``[uniep]``, a registry whose configs have it.
    The degrees the file leaves out are its registry config's, which only TorchTitan reads."""
    module, _ = _registry_module(launch.toml, launch.argv)
    check_uniep_module(launch.toml, launch.argv, config_path=launch.config_path)
    if module in _UNIEP_MODULES_0_3:
        # The configs of another registry have fields only TorchTitan's import of it knows (the worker's parse).
        check_section_names(launch.toml, launch.overrides, _SECTIONS_0_3, config_path=launch.config_path,
                            tables_only=True, also_known=_TOP_LEVEL_KEYS_0_3)
    _check_uniep_section(launch)


_LAUNCH_CHECKS = {EDGES["0.2.2"]: _check_launch_v0_2, EDGES["0.3.0"]: _check_launch_v0_3}
"""Edge package -> the launcher's checks of its release's train config."""


def check_launch(argv: list[str], world_size: int) -> Launch:
    """The standard-library checks (see the module docstring); ValueError naming the key and the fix."""
    try:
        edge = edge_module()
    except RuntimeError as err:
        raise ValueError(str(err)) from None
    path = config_file_arg(argv)
    toml = load_config_file(path) if path is not None else {}
    overrides = cli_overrides(argv)
    folder = _registry_dump_folder(toml, argv) if edge == EDGES["0.3.0"] else _dump_folder(toml, overrides)
    launch = Launch(path, toml, overrides, folder, list(argv))
    if help_requested(argv):
        return launch  # TorchTitan prints every key and exits
    check_toml_release(path, toml, edge)
    _LAUNCH_CHECKS[edge](launch, world_size)
    return launch


def _edge_checks():
    # The installed edge's own start-up checks (they import TorchTitan), by name: the shared
    # checks import no edge, so the launcher's stay free of torch and TorchTitan.
    return importlib.import_module(f"{edge_module()}.preflight")


def check_job(argv: list[str], world_size: int):
    """Every check (see the module docstring): ``check_launch``, then the installed edge's
    ``check_job``; returns the job's config as TorchTitan parsed it.

    Args:
        argv: the trainer's command line (``sys.argv[1:]``: ``--job.config_file X`` and overrides).
        world_size: the number of ranks (torchrun's ``WORLD_SIZE``).
    Raises:
        ValueError: naming the key (or ``NGPU`` / ``CONFIG_FILE``) and the fix.
    """
    return _edge_checks().check_job(check_launch(argv, world_size), world_size)


def preflight(argv: list[str], world_size: int) -> list[str]:
    """``check_job``; returns the edge's path overrides to add to the arguments."""
    return _edge_checks().path_overrides(check_job(argv, world_size))


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
