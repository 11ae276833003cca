"""The kernel schedules ``"sequential"`` and ``"fused"``: the custom op
``torch.ops.uniep.moe_experts`` (``titan_uniep.op``) on the layer's EP group."""

from __future__ import annotations

import torch
import torch.distributed as dist

import titan_uniep.op  # noqa: F401  (registers torch.ops.uniep.moe_experts)
from titan_uniep.schedules import register_schedule
from titan_uniep.schedules.interface import Routing


def _kernel_schedule(name: str):
    def run(x, routing: Routing, w1, w2, w3, *, group: dist.ProcessGroup, score_before_experts: bool,
            out_dtype: torch.dtype | None = None, master_weights: tuple | None = None) -> torch.Tensor:
        # master_weights: the fp32 (w1, w2, w3) the 16-bit weights are casts of,
        # which receive the weight gradients in fp32 (titan_uniep.op).
        if master_weights is not None and any(w.requires_grad for w in (w1, w2, w3)):
            raise ValueError("with master_weights, w1, w2 and w3 must be detached casts (the masters receive the "
                             "weight gradients, the casts none): cast with w.detach().to(dtype)")
        out, _h13 = torch.ops.uniep.moe_experts(
            x, routing.top_scores, routing.selected_experts_indices, w1, w2, w3,
            group.group_name, name, score_before_experts, out_dtype, *(master_weights or (None, None, None)),
        )
        return out

    run.__name__ = f"{name}_schedule"
    return run


register_schedule("sequential", _kernel_schedule("sequential"), needs_cuda=True)
register_schedule("fused", _kernel_schedule("fused"), needs_cuda=True)
