"""A TOML train config for TorchTitan 0.3.0, applied through TorchTitan's own config manager.

TorchTitan 0.3.0 has no TOML: a job is a config-registry function
(``--module M --config C``) plus CLI overrides. A UniEP TOML for 0.3.0 names
both and holds overrides, in the 0.3.0 config's own shape::

    module = "titan_uniep.torchtitan.v0_3"   # --module
    config = "qwen3_debug_moe_uniep"          # --config
    dump_folder = "./outputs/qwen3_debug_moe_uniep"

    [training]
    steps = 50

    [uniep]
    schedule = "reference"

``TomlConfigManager`` is TorchTitan's ``ConfigManager`` whose loaded config
(the registry function's) gets the file's values before TorchTitan's CLI
parse, so every field of the config tree is reachable from the file, the
command line still wins, and TorchTitan's own parse and checks run as
always. Each key is checked against the field it sets (an unknown key names
the closest one; a value of the wrong type names the type); every error names
the file and the line.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any, Literal

from torchtitan.config import ConfigManager

__all__ = ["TomlConfigManager", "apply_table", "toml_module_args"]

_TOP_LEVEL_ARGS = ("module", "config")
"""Top-level keys of the file that are ConfigManager's own arguments, not config fields."""


def toml_module_args(path: str, toml: dict, argv: list[str]) -> list[str]:
    """``--module M --config C`` from the file, for those the command line does not set itself."""
    args = []
    for key in _TOP_LEVEL_ARGS:
        given = any(a == f"--{key}" or a.startswith(f"--{key}=") for a in argv)
        if key not in toml and not given:
            raise ValueError(f"config file {path!r} names no {key}: add a top-level line "
                             f"{key} = \"...\" (e.g. module = \"titan_uniep.torchtitan.v0_3\", "
                             "config = \"qwen3_debug_moe_uniep\"), or pass --" + key)
        if key in toml and not given:
            if not isinstance(toml[key], str):
                raise ValueError(f"config file {path!r}, {_where(path, (key,))}: {key} must be a string, "
                                 f"got {toml[key]!r}")
            args += [f"--{key}", toml[key]]
    return args


def _line_of(text: str, keys: tuple[str, ...]) -> int | None:
    """The 1-based line of ``keys`` (``("training", "steps")``) in the TOML ``text``: the
    ``key =`` line under its ``[table]`` header, or the header of a table; None if not found."""
    table, key = keys[:-1], keys[-1]
    current: tuple[str, ...] = ()
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        header = re.fullmatch(r"\[\s*([^\[\]]+?)\s*\]\s*(#.*)?", stripped)
        if header:
            current = tuple(part.strip().strip('"') for part in header.group(1).split("."))
            if current == keys:
                return number
            continue
        match = re.match(r'("?)([\w-]+)\1\s*=', stripped)
        if match and current == table and match.group(2) == key:
            return number
    return None


_TEXTS: dict[str, str] = {}


def _where(path: str, keys: tuple[str, ...]) -> str:
    line = _line_of(_TEXTS.get(path, ""), keys)
    name = ".".join(keys)
    return f"line {line} ({name})" if line else name


def _matches(value: Any, hint: Any) -> bool:
    """Whether a TOML value can stand for a field annotated ``hint``."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin is typing.Annotated:
        return _matches(value, typing.get_args(hint)[0])
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return isinstance(value, list) and all(any(_matches(v, a) for a in args) if args else True for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # an annotation this check does not read: TorchTitan's parse judges the value


def _describe(hint: Any) -> str:
    return re.sub(r"\b(typing|torchtitan\.[\w.]+)\.", "", str(hint)).replace("<class '", "").replace("'>", "")


def apply_table(node: Any, table: dict, path: str, prefix: tuple[str, ...] = ()) -> None:
    """Set ``table``'s values on the config ``node`` (in place), recursing into sub-tables.

    Raises:
        ValueError: naming the file, the line and the key: an unknown key (with the
            closest one), a value of the wrong type, a table for a field that is no section.
    """
    hints = typing.get_type_hints(type(node))
    fields = {f.name: f for f in dataclasses.fields(node) if f.init}
    section = ".".join(prefix) or "the top level"
    for key, value in table.items():
        keys = (*prefix, key)
        if not prefix and key in _TOP_LEVEL_ARGS:
            continue
        if key not in fields and keys == ("uniep",):
            raise ValueError(
                f"config file {path!r}, {_where(path, keys)}: this config ({type(node).__qualname__}) has no uniep "
                "section, so it would train without UniEP. UniEP's options belong to the configs of "
                "titan_uniep.torchtitan.v0_3 (UniEPTrainer.Config): set module = \"titan_uniep.torchtitan.v0_3\" "
                "and one of its configs, or remove [uniep]."
            )
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else "."
            raise ValueError(f"config file {path!r}, {_where(path, keys)}: {key} is not a key of {section}{hint} "
                             f"Fix the key (the keys: {', '.join(sorted(fields))}).")
        current = getattr(node, key)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            apply_table(current, value, path, keys)
            continue
        if isinstance(value, dict) and not _matches(value, hints.get(key, Any)):
            raise ValueError(f"config file {path!r}, {_where(path, keys)}: {'.'.join(keys)} is not a section "
                             f"(its type is {_describe(hints.get(key))}); write {key} = <value> under [{section}].")
        if not _matches(value, hints.get(key, Any)):
            raise ValueError(f"config file {path!r}, {_where(path, keys)}: {'.'.join(keys)} = {value!r} is not "
                             f"of type {_describe(hints.get(key))}. Fix the value.")
        setattr(node, key, value)


class TomlConfigManager(ConfigManager):
    """TorchTitan's ``ConfigManager`` with a TOML file's values applied to the loaded config.

    ``parse_args(args)`` loads the registry config that ``--module`` / ``--config``
    name (from the file unless the command line names them), sets the file's
    values on it, then lets TorchTitan's tyro parse apply the command line on
    top, rebuild the config (running every ``__post_init__`` check) and
    validate it.
    """

    def __init__(self, path: str, toml: dict, text: str):
        super().__init__()
        self.path, self.toml = path, toml
        _TEXTS[path] = text

    def parse_args(self, args: list[str] | None = None):
        args = list(args or [])
        return super().parse_args(toml_module_args(self.path, self.toml, args) + args)

    def _load_config(self, args: list[str]) -> tuple[object, list[str]]:
        loaded, rest = super()._load_config(args)
        apply_table(loaded, self.toml, self.path)
        return loaded, rest
