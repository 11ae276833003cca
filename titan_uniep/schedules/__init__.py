"""The schedules of one MoE layer's expert-parallel path, by name.

A schedule maps this rank's tokens, their routing and this rank's local
expert weights to the combined routed-expert output of its tokens
(``interface.ScheduleFn``). Every schedule places rows with
``titan_uniep.layout`` and sums a token's K rows in the fixed order
k = 0..K-1 in fp32.

- ``"reference"`` (``schedules.reference``): torch collectives, one matmul per
  expert, autograd through torch; runs anywhere, imports no Triton.
- ``"sequential"`` / ``"fused"`` (``schedules.kernel``): UniEP's kernels
  behind the custom op ``torch.ops.uniep.moe_experts``; imported only when
  asked for, so the reference path never loads Triton's kernels.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from titan_uniep.schedules.interface import Routing, ScheduleFn
from titan_uniep.schedules.reference import reference_schedule

__all__ = ["Routing", "ScheduleFn", "available_schedules", "get_schedule", "register_schedule"]


@dataclass(frozen=True)
class _Entry:
    fn: ScheduleFn
    needs_cuda: bool


_REGISTRY: dict[str, _Entry] = {"reference": _Entry(reference_schedule, needs_cuda=False)}
# Schedules whose module registers them when imported: name -> (module, needs CUDA).
_ON_IMPORT = {"sequential": ("titan_uniep.schedules.kernel", True), "fused": ("titan_uniep.schedules.kernel", True)}


def register_schedule(name: str, fn: ScheduleFn, *, needs_cuda: bool) -> None:
    """Make ``[uniep] schedule = name`` run ``fn``."""
    _REGISTRY[name] = _Entry(fn, needs_cuda)


def available_schedules() -> dict[str, bool]:
    """Schedule names -> whether each needs CUDA (imports nothing)."""
    names = {name: cuda for name, (_module, cuda) in _ON_IMPORT.items()}
    names.update({name: entry.needs_cuda for name, entry in _REGISTRY.items()})
    return names


def get_schedule(name: str) -> ScheduleFn:
    if name not in _REGISTRY and name in _ON_IMPORT:
        importlib.import_module(_ON_IMPORT[name][0])
    if name not in _REGISTRY:
        raise ValueError(f"[uniep] schedule = {name!r} is not available; available: {sorted(available_schedules())}")
    return _REGISTRY[name].fn
