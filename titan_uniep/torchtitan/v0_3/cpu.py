"""Let TorchTitan 0.3.0 train on a machine without a GPU (gloo, one process per core).

Each shim works around exactly one place where TorchTitan 0.3.0 assumes an
accelerator, and names it. ``apply_cpu_shims`` does nothing where CUDA is
available, so GPU runs are untouched. They exist so the end-to-end path
(config -> model -> parallelize -> FSDP x EP over gloo -> loss curve) is
testable on CPU-only CI and dev machines; numbers from such runs say nothing
about GPU speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask
from torchtitan.config import derive
from torchtitan.models.common.attention import FlexAttention

from titan_uniep.torchtitan.cpu_device import CpuDeviceModule, with_sum_only_reductions

__all__ = ["CPU_ARGS", "DenseMaskAttention", "apply_cpu_shims", "use_dense_mask_attention"]

CPU_ARGS = ["--training.disable_cuda_graphs", "--parallelism.spmd_backend", "partial_dtensor",
            "--comm.trace_buf_size", "0"]
"""TorchTitan overrides of every CPU run, ahead of the user's (which still win).
``disable_cuda_graphs``: there are no CUDA graphs on a CPU (the trainer's graph
wrapper runs eagerly there), but the config's own check still refuses expert
parallelism with TorchTitan's all-to-all dispatcher under them (trainer.py,
``_validate_cuda_graphs``), the baseline's dispatcher at EP > 1.
``spmd_backend = "partial_dtensor"``: the default ``"spmd_types"`` exchanges
the tokens of TorchTitan's all-to-all dispatcher with ``dist.all_to_all`` over
per-rank tensors of uneven sizes, which gloo refuses ("invalid tensor size");
``partial_dtensor`` uses ``all_to_all_single`` with split sizes, which gloo runs.
``trace_buf_size = 0``: the flight recorder only records NCCL, and would
create an empty ``comm_traces`` folder."""

_applied = False


def _use_cpu_device() -> None:
    # tools/utils.py picks device_type "cuda" without an accelerator; these
    # modules bound device_type/device_module at import, so each needs its own copy.
    from torchtitan.components import metrics
    from torchtitan.distributed import parallel_dims, utils as dist_utils
    from torchtitan.models.common import token_dispatcher
    from torchtitan.tools import profiler, utils

    for module in (utils, metrics, parallel_dims, dist_utils, token_dispatcher, profiler):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"  # init_distributed then picks gloo
        if hasattr(module, "device_module"):
            module.device_module = CpuDeviceModule
    # MFU's peak: lspci finds no GPU, and TorchTitan falls back to an A100's with
    # a warning per call; the A100 figure stays, so CPU MFU reads as in 0.2.2 runs.
    utils.get_peak_flops = lambda device_name: 312e12


def _fsdp_sum_only_reductions() -> None:
    # apply_fsdp ends with disable_fsdp_gradient_division (distributed/fsdp.py),
    # which sets divide factor 1.0; FSDP then reduce-scatters with
    # ReduceOp.PREMUL_SUM, which gloo lacks. SUM-only comms keep the math
    # (a post-division by 1.0).
    from torchtitan.distributed import fsdp

    fsdp.disable_fsdp_gradient_division = with_sum_only_reductions(fsdp.disable_fsdp_gradient_division)


def apply_cpu_shims() -> bool:
    """Apply every process-wide shim once if CUDA is unavailable; return whether
    they are active. Call it before the trainer is built; the model config
    needs ``use_dense_mask_attention`` too."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        _use_cpu_device()
        _fsdp_sum_only_reductions()
        _applied = True
    return True


class DenseMaskAttention(FlexAttention):
    """FlexAttention's inner attention computed with a dense mask, for CPUs.

    TorchTitan 0.3.0's language models attend through FlexAttention only
    (``attn_backend = "sdpa"`` is refused), and FlexAttention has no backward
    on CPU (torch raises "FlexAttention does not support backward on CPU").
    This computes the same attention: the block mask's ``mask_mod`` evaluated
    on every (query, key) pair, then scaled dot-product attention with that
    boolean mask. Memory grows with ``seq_len**2``: CPU test sizes only.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *, attention_masks,
                score_mod=None, scale: float | None = None, enable_gqa: bool = False, out_transform=None,
                **kwargs) -> torch.Tensor:
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError(
                "DenseMaskAttention (the CPU shim for FlexAttention) takes no score_mod or out_transform; "
                "this model's attention needs FlexAttention on a GPU"
            )
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # (B, N, L, H)
        mask = create_mask(attention_masks.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def use_dense_mask_attention(model_config) -> int:
    """Replace (in place) every FlexAttention node of ``model_config`` with
    ``DenseMaskAttention``; return how many there were."""
    nodes = list(model_config.traverse(FlexAttention.Config))
    for _fqn, cfg, parent, attr in nodes:
        new = derive(cfg, DenseMaskAttention.Config)
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return len(nodes)
