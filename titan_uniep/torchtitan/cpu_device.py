"""What a TorchTitan run without a GPU needs from ``torch.cuda`` and from gloo, for every edge's CPU shims."""

from __future__ import annotations

import functools
import os
import platform
import resource
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch.distributed.fsdp import FSDPModule

__all__ = ["CpuDeviceModule", "cpu_has_native_bf16", "with_sum_only_reductions"]


class CpuDeviceModule:
    """Stands in for ``torch.cuda`` where TorchTitan calls it unconditionally.

    TorchTitan (0.2.2 and 0.3.0, tools/utils.py) picks ``device_type =
    _get_available_device_type() or "cuda"``, so without a GPU every
    ``device_module.*`` call lands on torch.cuda and fails. ``torch.cpu`` lacks
    the memory-statistics calls, and ``torch.cpu.current_device()`` returns
    "cpu", which the barrier in ``set_pg_timeouts`` cannot turn into a device.
    The line numbers below are TorchTitan 0.2.2's.
    """

    @staticmethod
    def set_device(device: torch.device) -> None:  # train.py:90
        pass

    @staticmethod
    def current_device() -> int:  # metrics.py:46, distributed/utils.py:386
        return 0

    @staticmethod
    def synchronize(device: torch.device | None = None) -> None:  # distributed/utils.py:387
        pass

    @staticmethod
    def get_device_name(device: torch.device | None = None) -> str:  # metrics.py:45
        return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"

    @staticmethod
    def get_device_properties(device: torch.device | None = None) -> SimpleNamespace:  # metrics.py:47
        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device: torch.device | None = None) -> dict:  # metrics.py:65
        # The process's peak resident set: a whole-process figure that is
        # never reset, but enough to see a CPU run's memory grow.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    @staticmethod
    def reset_peak_memory_stats(device: torch.device | None = None) -> None:  # metrics.py:52,95
        pass

    @staticmethod
    def empty_cache() -> None:  # metrics.py:53
        pass


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (x86: AVX512-BF16 or AMX-BF16;
    Arm: the BF16 extension). Elsewhere bf16 matmuls are emulated, an order of
    magnitude slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set()
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def with_sum_only_reductions(disable_division: Callable[[torch.nn.Module], None]) -> Callable[[torch.nn.Module], None]:
    """TorchTitan's ``disable_fsdp_gradient_division`` (every release ends FSDP's
    setup with it) followed by SUM-only reductions on every FSDP module. It sets
    FSDP's divide factor to 1.0, and FSDP then reduce-scatters with
    ``ReduceOp.PREMUL_SUM``, which gloo lacks; a SUM with a post-division by 1.0
    keeps the math."""

    @functools.wraps(disable_division)
    def disable_division_with_sum_only_comms(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    return disable_division_with_sum_only_comms
