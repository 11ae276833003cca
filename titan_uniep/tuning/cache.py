"""The measured-tuning cache: one JSON file of tuned ``LayerParams`` per layer shape.

``python -m titan_uniep.tools.tune`` writes it; ``[uniep] tuning = "cached"`` (and
``"search"``, after measuring) reads it, as do ``bench --report`` and
``bench --tuned-cache``. It is plain JSON (``json.load``, never unpickled),
indented, one entry per tuned layer, meant to be read and diffed by people::

    {
      "format": "titan_uniep tuning cache",
      "version": 2,
      "entries": [
        {
          "key": {"gpu": "NVIDIA H200", "ep_size": 1, "dtype": "bfloat16",
                  "token_bucket": 16384, "dim": 2048, "hidden": 768,
                  "num_experts": 128, "top_k": 8, "score_before_experts": false,
                  "kernel_version": "5d41402abc4b2a76"},
          "forward": {"fc2_block_n": 128, "dispatch_programs": 32},
          "backward": {},
          "measured_ms": {"forward": {"default": 1.91, "tuned": 1.74},
                          "backward": {"default": 4.20, "tuned": 4.20}},
          "predicted_ms": {"forward": {"default": 1.85, "tuned": 1.70},
                           "backward": {"default": 4.1, "tuned": 4.1}},
          "tokens": 16384, "schedule": "fused", "candidates": 6, "weight_grad_dtype": "float32",
          "date": "2026-12-01"
        }
      ]
    }

The key (``CacheKey``): the GPU's name (``torch.cuda.get_device_name``), the
EP size, the activation dtype, the layer shape (``D``, ``H``, ``E``, ``K``
and the score mode: scores before the experts compile other kernels),
the token bucket (tokens per rank rounded up to a multiple of
``TOKEN_BUCKET`` = 4096: a run of 6000 tokens per rank uses the entry tuned
at 8192) and the kernel version (``kernel_version()``: a hash of the
kernels', the host runtime's and ``params.py``'s sources and of the Triton
version; any edit there retires every entry). ``forward`` / ``backward``:
the ``LayerParams`` fields whose tuned value differs from the shipped
default (``params.default_params(ep_size, hidden=H)``) for the forward and the
backward workspace; ``{}`` means the default measured fastest. The other
fields record what the tuner saw (median ms of the default and the tuned
point, the model's prediction of both, the token count measured, the
schedule, how many candidates were measured, the weight gradients' dtype
the backward was timed in, the date). That dtype is not part of the key:
an entry gives the default's bits with the weight gradients in either
dtype (the tuner checks both), and its weight-gradient tiles are read only
where the Triton kernel writes them (fp32 gradients).

Every entry gives the default point's bits (the tuner refuses to write one
that does not). ``lookup`` applies an entry only if every key field
matches; an entry for the same shape from another GPU, EP size or kernel
version is refused, and the reason names the field that differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from datetime import date
from functools import cache
from pathlib import Path

import torch

from ..params import LayerParams, default_params

__all__ = [
    "CACHE_FORMAT",
    "CACHE_VERSION",
    "CacheEntry",
    "CacheKey",
    "DIRECTIONS",
    "TOKEN_BUCKET",
    "default_cache_path",
    "dtype_name",
    "kernel_version",
    "load",
    "lookup",
    "lookup_file",
    "merge",
    "save",
    "token_bucket",
]

CACHE_FORMAT = "titan_uniep tuning cache"
CACHE_VERSION = 2  # 2: the score mode is part of the key
TOKEN_BUCKET = 4096
DIRECTIONS = ("forward", "backward")
# Sources whose edits can change what a parameter point costs (kernel_version).
_VERSIONED_SOURCES = ("kernels/*.py", "runtime/*.py", "params.py")
_PACKAGE = Path(__file__).resolve().parents[1]
_SHAPE_FIELDS = ("dtype", "token_bucket", "dim", "hidden", "num_experts", "top_k", "score_before_experts")
_MACHINE_FIELDS = ("gpu", "ep_size", "kernel_version")


def default_cache_path() -> str:
    """``$XDG_CACHE_HOME/titan_uniep/tuning.json`` (``~/.cache/...`` without
    XDG_CACHE_HOME): the tuner's and ``[uniep] tuning_cache``'s default."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "titan_uniep", "tuning.json")


@cache
def kernel_version() -> str:
    """16 hex digits of sha256 over the kernels', ``runtime/``'s and
    ``params.py``'s sources (paths and bytes, sorted) and the Triton version."""
    import triton

    return source_digest(_PACKAGE, triton.__version__)


def source_digest(package: Path, triton_version: str) -> str:
    """``kernel_version`` of the package folder ``package``."""
    digest = hashlib.sha256(f"triton {triton_version}\n".encode())
    for pattern in _VERSIONED_SOURCES:
        for path in sorted(package.glob(pattern)):
            digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def token_bucket(num_tokens: int) -> int:
    """Tokens per rank rounded up to a multiple of ``TOKEN_BUCKET`` (at least one bucket)."""
    return max(1, -(-num_tokens // TOKEN_BUCKET)) * TOKEN_BUCKET


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CacheKey:
    """What an entry applies to (see the module docstring)."""

    gpu: str
    ep_size: int
    dtype: str
    token_bucket: int
    dim: int
    hidden: int
    num_experts: int
    top_k: int
    score_before_experts: bool
    kernel_version: str

    @classmethod
    def for_layer(cls, *, gpu: str, ep_size: int, dtype: torch.dtype | str, num_tokens: int, dim: int, hidden: int,
                  num_experts: int, top_k: int, score_before_experts: bool, version: str | None = None) -> "CacheKey":
        """The key of a layer of ``num_tokens`` tokens per rank (bucketed);
        ``version`` defaults to this tree's ``kernel_version()``."""
        return cls(gpu=gpu, ep_size=ep_size, dtype=dtype if isinstance(dtype, str) else dtype_name(dtype),
                   token_bucket=token_bucket(num_tokens), dim=dim, hidden=hidden, num_experts=num_experts,
                   top_k=top_k, score_before_experts=bool(score_before_experts),
                   kernel_version=version or kernel_version())

    def describe(self) -> str:
        scores = "scores before the experts" if self.score_before_experts else "scores after the experts"
        return (f"T<={self.token_bucket} D={self.dim} H={self.hidden} E={self.num_experts} K={self.top_k} "
                f"{self.dtype} {scores}, EP {self.ep_size}, {self.gpu!r}, kernels {self.kernel_version}")


@dataclass
class CacheEntry:
    """One tuned layer: its key, the changed fields per direction, and what was measured."""

    key: CacheKey
    forward: dict[str, object]
    backward: dict[str, object]
    measured_ms: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    predicted_ms: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    tokens: int = 0
    schedule: str = "fused"
    candidates: int = 0
    weight_grad_dtype: str = ""
    date: str = dataclasses.field(default_factory=lambda: str(date.today()))

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["key"] = dataclasses.asdict(self.key)
        return out

    @classmethod
    def from_json(cls, item: dict, where: str) -> "CacheEntry":
        if not isinstance(item, dict) or not isinstance(item.get("key"), dict):
            raise ValueError(f"{where}: an entry must be an object with a 'key' object, got {item!r:.200}")
        key_fields = {f.name for f in dataclasses.fields(CacheKey)}
        if set(item["key"]) != key_fields:
            raise ValueError(f"{where}: key fields {sorted(item['key'])} are not {sorted(key_fields)}")
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := set(item) - known:
            raise ValueError(f"{where}: unknown entry fields {sorted(unknown)} (known: {sorted(known)})")
        for direction in DIRECTIONS:
            if not isinstance(item.get(direction), dict):
                raise ValueError(f"{where}: '{direction}' must be an object of LayerParams fields")
        return cls(**{**item, "key": CacheKey(**item["key"])})


# An error names what is wrong with the file and how to name another one. Deleting it is advised
# only for a file that is recognisably a cache of ours (a JSON object whose "format" is
# CACHE_FORMAT): any other file at that path (a typo, /etc/hostname) is someone else's, and
# the option, not the file, is what to change.
_NAME_ANOTHER_FILE = ("name another file for the cache (--uniep.tuning_cache PATH, or --cache PATH of "
                      "titan_uniep.tools.tune)")


def load(path: str | os.PathLike) -> list[CacheEntry]:
    """The entries of the cache file at ``path`` (``[]`` if it does not exist).

    Raises:
        ValueError: naming the file and what is wrong with it: it cannot be read; it
            is not a tuning cache (not JSON, or no ``"format": CACHE_FORMAT``), so
            someone else's file, left alone; or it is a cache of ours, of another
            ``CACHE_VERSION`` or with a malformed entry (retune, or delete it).
    """
    path = Path(path)
    if not path.exists():
        return []
    not_ours = (f"so titan_uniep did not write it (its tuning caches are JSON objects with \"format\": "
                f"\"{CACHE_FORMAT}\"): leave it as it is and {_NAME_ANOTHER_FILE}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:  # a folder, no read permission, ...
        raise ValueError(f"tuning cache {path} cannot be read ({err.strerror or err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"tuning cache {path} is not JSON ({err}), {not_ours}") from None
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        raise ValueError(f"tuning cache {path} is not a {CACHE_FORMAT!r} file (no matching 'format' field), {not_ours}")
    ours = "a titan_uniep tuning cache, whose entries the tuner measures again"
    if data.get("version") != CACHE_VERSION:
        raise ValueError(f"tuning cache {path} has version {data.get('version')!r}, this titan_uniep reads "
                         f"version {CACHE_VERSION}: retune (python -m titan_uniep.tools.tune) into a new file, or "
                         f"delete this one ({ours})")
    try:
        if not isinstance(data.get("entries"), list):
            raise ValueError(f"tuning cache {path}: 'entries' must be a list")
        return [CacheEntry.from_json(item, f"tuning cache {path}, entry {i}")
                for i, item in enumerate(data["entries"])]
    except ValueError as err:
        raise ValueError(f"{err}. The file is {ours}: delete it, or {_NAME_ANOTHER_FILE}") from None


def merge(entries: list[CacheEntry], new: list[CacheEntry]) -> list[CacheEntry]:
    """``entries`` with ``new`` added; a new entry replaces one with the same key."""
    by_key = {entry.key: entry for entry in entries}
    by_key.update({entry.key: entry for entry in new})
    return sorted(by_key.values(), key=lambda e: dataclasses.astuple(e.key))


def save(path: str | os.PathLike, new: list[CacheEntry]) -> list[CacheEntry]:
    """Merge ``new`` into the file at ``path`` (created with its folder if
    missing; written to a temporary file, then renamed). Returns all entries."""
    path = Path(path)
    entries = merge(load(path), new)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"format": CACHE_FORMAT, "version": CACHE_VERSION,
                       "entries": [entry.to_json() for entry in entries]}, indent=1)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return entries


def lookup(entries: list[CacheEntry], key: CacheKey, direction: str) -> tuple[LayerParams | None, str]:
    """``(params, reason)``: the tuned point of ``direction`` (``"forward"`` or
    ``"backward"``) for ``key``, the shipped default with the entry's fields,
    or ``None`` and why no entry applies: none for this shape, or only
    entries of another GPU / EP size / kernel version (named), or an entry
    whose fields this ``LayerParams`` rejects."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    for entry in entries:
        if entry.key == key:
            changes = getattr(entry, direction)
            try:
                params = default_params(key.ep_size, hidden=key.hidden).replace(**changes)
            except (TypeError, ValueError) as err:
                return None, (f"the entry for {key.describe()} does not fit this LayerParams ({err}); "
                              "retune with python -m titan_uniep.tools.tune")
            measured = entry.measured_ms.get(direction, {})
            return params, (f"tuned {entry.date}: {direction} {measured.get('default', float('nan')):.3f} -> "
                            f"{measured.get('tuned', float('nan')):.3f} ms, changes {changes or 'none'}")
    same_shape = [e for e in entries if all(getattr(e.key, f) == getattr(key, f) for f in _SHAPE_FIELDS)]
    if not same_shape:
        return None, f"no tuned entry for {key.describe()}"
    foreign = []
    for entry in same_shape:
        differ = [f"{f} {getattr(entry.key, f)!r} (here {getattr(key, f)!r})" for f in _MACHINE_FIELDS
                  if getattr(entry.key, f) != getattr(key, f)]
        foreign.append(", ".join(differ))
    return None, (f"refused the tuned entries for {key.describe().split(', EP')[0]}: they were measured with another "
                  + "; another ".join(foreign) + ". Retune on this machine: python -m titan_uniep.tools.tune")


def lookup_file(path: str | os.PathLike, key: CacheKey) -> dict[str, tuple[LayerParams | None, str]]:
    """``lookup`` of both directions in the file at ``path`` (benchmarks): a
    file that cannot be read gives ``(None, why)`` for both instead of raising."""
    try:
        entries = load(path)
    except ValueError as err:
        return {direction: (None, str(err)) for direction in DIRECTIONS}
    return {direction: lookup(entries, key, direction) for direction in DIRECTIONS}
