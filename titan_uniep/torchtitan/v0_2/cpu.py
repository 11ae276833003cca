"""Let TorchTitan 0.2.2 train on a machine without a GPU (gloo, one process per core).

TorchTitan 0.2.2 assumes an accelerator in a few places; each shim below
works around exactly one of them and names the line it works around.
``apply_cpu_shims`` does nothing where CUDA is available, so GPU runs are
untouched; ``apply_cpu_tensor_shims``, the part that acts on CPU tensors
only, serves a CPU layer in a process with CUDA too (tests). They exist so
the end-to-end path (config -> train spec -> parallelize -> FSDP x EP over
gloo -> loss curve) is testable on CPU-only CI and dev machines; numbers from
such runs say nothing about GPU speed.
"""

from __future__ import annotations

import functools
import warnings

import torch

from titan_uniep.torchtitan.cpu_device import CpuDeviceModule, cpu_has_native_bf16, with_sum_only_reductions

_applied = False
_tensor_shims_applied = False


def _use_cpu_device() -> None:
    # These modules bound ``device_type``/``device_module`` at import
    # (``from torchtitan.tools.utils import ...``), so each needs its own copy.
    from torchtitan.components import metrics
    from torchtitan.distributed import parallel_dims, utils as dist_utils
    from torchtitan.tools import profiling, utils

    for module in (utils, metrics, parallel_dims, dist_utils, profiling):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"  # init_distributed then picks gloo (distributed/utils.py:328)
        if hasattr(module, "device_module"):
            module.device_module = CpuDeviceModule


def _histc_integer_on_cpu() -> None:
    # models/moe/moe.py:348 and :399 count tokens per expert with torch.histc
    # on int64 expert ids; the CPU kernel has no integer version (CUDA does).
    # Counts are small integers, exact in float32. CPU tensors only.
    histc = torch.histc

    @functools.wraps(histc)
    def histc_any_dtype(input, bins=100, min=0, max=0, *, out=None):
        if out is None and input.device.type == "cpu" and not input.is_floating_point():
            return histc(input.float(), bins=bins, min=min, max=max).to(input.dtype)
        return histc(input, bins=bins, min=min, max=max, out=out)

    torch.histc = histc_any_dtype


def _permute_indices_on_cpu() -> None:
    # ExpertParallel's token dispatch calls _permute (models/moe/utils.py:47),
    # which calls the Triton version of generate_permute_indices unless
    # use_cpu=True; TorchTitan never passes it. Counts on the CPU take the CPU
    # version; counts on a GPU keep TorchTitan's choice.
    from torchtitan.models.moe import kernels, utils as moe_utils

    generate = kernels.generate_permute_indices

    @functools.wraps(generate)
    def generate_where_the_counts_are(tokens_per_expert_group, *args, use_cpu=False, **kwargs):
        use_cpu = use_cpu or tokens_per_expert_group.device.type == "cpu"
        return generate(tokens_per_expert_group, *args, use_cpu=use_cpu, **kwargs)

    moe_utils.generate_permute_indices = generate_where_the_counts_are


def apply_cpu_tensor_shims() -> None:
    """The shims TorchTitan's MoE layers need on CPU tensors (the integer
    ``histc`` of the router, the CPU token permutation), once per process. Each
    acts on CPU tensors only, so a process that also has CUDA (the tests that
    run a TorchTitan layer on CPU on a GPU machine) may apply them."""
    global _tensor_shims_applied
    if not _tensor_shims_applied:
        _histc_integer_on_cpu()
        _permute_indices_on_cpu()
        _tensor_shims_applied = True


def _fsdp_sum_only_reductions() -> None:
    # apply_fsdp ends with disable_fsdp_gradient_division (llama3/infra/
    # parallelize.py:284, reused by llama4, deepseek_v3 and qwen3), which sets
    # divide factor 1.0; FSDP then reduce-scatters with ReduceOp.PREMUL_SUM
    # (or AVG when the factor equals the group size), and gloo has neither.
    # Forcing SUM-only comms keeps the math (a post-division by 1.0).
    from torchtitan.models.llama3.infra import parallelize as llama3_parallelize
    from torchtitan.models.llama4.infra import parallelize as llama4_parallelize

    sum_only = with_sum_only_reductions(llama3_parallelize.disable_fsdp_gradient_division)
    # llama4's module imported the function by name, so it holds its own reference.
    llama3_parallelize.disable_fsdp_gradient_division = sum_only
    llama4_parallelize.disable_fsdp_gradient_division = sum_only


def apply_cpu_shims() -> bool:
    """Apply every shim once if CUDA is unavailable; return whether they are active.

    Call it before ``torchtitan.train.Trainer`` is constructed. A no-op (False)
    on machines with CUDA.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        _use_cpu_device()
        apply_cpu_tensor_shims()
        _fsdp_sum_only_reductions()
        _quiet_gpu_only_warnings()
        _applied = True
    return True


CPU_ARGS = ["--comm.trace_buf_size", "0"]
"""TorchTitan overrides of every CPU run, ahead of the user's (which still win).
``trace_buf_size = 0``: TorchTitan's flight recorder dumps NCCL's collective traces
on a timeout into ``<dump_folder>/comm_traces`` (distributed/utils.py:350), a folder
it creates at start-up; over gloo it stays empty."""


def _quiet_gpu_only_warnings() -> None:
    # Each line below said something only about running without a GPU, the point of these shims:
    # torch warns that DTensor's RNG on a CPU mesh "may not have complete support" (seeded CPU
    # runs reproduce their bits: tests/test_train_cpu.py), and TorchTitan's MFU looks for an
    # H100 with lspci (tools/utils.py:79) and then falls back to an A100's peak with a warning
    # (:143), twice per run. The A100 figure stays, so MFU on CPU reads as before.
    from torchtitan.tools import utils

    warnings.filterwarnings("ignore", r"DTensor (random operators|manual_seed\(\)) may not have complete support "
                                      "on cpu device mesh", UserWarning)
    utils.get_peak_flops = lambda device_name: _A100_PEAK_FLOPS


_A100_PEAK_FLOPS = 312e12  # TorchTitan's fallback for a device it does not know (tools/utils.py:143)


def fp32_compute_args() -> list[str]:
    """TorchTitan overrides that compute in fp32 on a CPU without native bf16
    (none elsewhere, and none on GPUs). They go before the user's own
    arguments, so ``--training.mixed_precision_param bfloat16`` still wins."""
    if torch.cuda.is_available() or cpu_has_native_bf16():
        return []
    return ["--training.mixed_precision_param", "float32"]
