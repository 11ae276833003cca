"""UniEP's kernel schedules as a ``torch.library`` op with registered autograd.

``torch.ops.uniep.moe_experts`` runs one MoE layer's routed-expert path
(dispatch, expert FFN, combine) with the ``"sequential"`` or ``"fused"``
kernels of ``titan_uniep.fused`` on real EP (one process per GPU). Being a
custom op makes it opaque to ``torch.compile`` (the rest of the model still
compiles) and lets selective activation checkpointing save its output
(``titan_uniep.parallelize`` adds it to TorchTitan's SAC save list).

Backward: the backward megakernels of ``titan_uniep.fused_backward`` with
the same schedule as the forward. The op saves only its inputs; the backward
re-dispatches x next to the output gradient and recomputes h1 and h3 (the
score gradient needs no fc2: ``<dOut, y> = <dOut @ w2, h>``). Every gradient
is bitwise equal across ``sequential`` and ``fused``; the fused backward does
not synchronise with the host (errors are polled lazily).

Workspaces: one forward and one backward workspace per (EP group, layer
shape, dtype, device), built on first use (a collective: every EP rank
reaches its first MoE layer together) and reused by every layer and step,
sized for the largest token count known then (``reserve_tokens``, set by the
parallelize hook from the job's batch and sequence length).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from titan_uniep.fused import moe_forward
from titan_uniep.fused_backward import BackwardWorkspace, moe_backward
from titan_uniep.schedules import Routing, register_schedule
from titan_uniep.symm import Workspace

__all__ = ["moe_experts", "reserve_tokens", "workspace_for"]

_workspaces: dict[tuple, Workspace | BackwardWorkspace] = {}
_reserved_tokens: dict[str, int] = {}


def reserve_tokens(group: dist.ProcessGroup, num_tokens: int) -> None:
    """Size the group's workspaces for ``num_tokens`` tokens per rank per call
    (call it on every rank before the first MoE forward)."""
    name = group.group_name
    _reserved_tokens[name] = max(_reserved_tokens.get(name, 0), num_tokens)


def workspace_for(
    group_name: str, x: torch.Tensor, w1: torch.Tensor, top_k: int, *, backward: bool = False
) -> Workspace | BackwardWorkspace:
    """The forward (or backward) workspace of this group and layer shape, built on first use."""
    group = _resolve_process_group(group_name)
    num_experts = w1.shape[0] * dist.get_world_size(group)
    key = (group_name, backward, x.shape[1], w1.shape[1], num_experts, top_k, x.dtype, x.device)
    ws = _workspaces.get(key)
    num_tokens = x.shape[0]
    if ws is None:
        capacity = max(num_tokens, _reserved_tokens.get(group_name, 0), 1)
        ws = (BackwardWorkspace if backward else Workspace).for_group(
            group, num_tokens=capacity, dim=x.shape[1], hidden=w1.shape[1], num_experts=num_experts,
            top_k=top_k, dtype=x.dtype, device=x.device,
        )
        _workspaces[key] = ws
    elif num_tokens > (capacity := getattr(ws, "inner", ws).shape.token_capacity):
        # Growing is a collective; a single rank discovering it mid-step
        # cannot make its peers join, so fail clearly instead of hanging.
        raise RuntimeError(
            f"UniEP workspace holds {capacity} tokens per rank, this MoE call has {num_tokens}. "
            "Call titan_uniep.ops.reserve_tokens(ep_group, N) on every rank before the first step, "
            "or Workspace.ensure_capacity(N) on every rank between steps."
        )
    return ws


@torch.library.custom_op("uniep::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    top_scores: torch.Tensor,
    selected_experts_indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    group_name: str,
    schedule: str,
    score_before_experts: bool,
) -> torch.Tensor:
    """Routed-expert output ``(T, D)`` of this rank's tokens (see titan_uniep.fused)."""
    ws = workspace_for(group_name, x, w1, selected_experts_indices.shape[1])
    return moe_forward(
        x, top_scores, selected_experts_indices, w1.contiguous(), w2.contiguous(), w3.contiguous(),
        workspace=ws, schedule=schedule, score_before_experts=score_before_experts,
    )


@moe_experts.register_fake
def _moe_experts_fake(x, top_scores, selected_experts_indices, w1, w2, w3, group_name, schedule, score_before_experts):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output) -> None:
    x, top_scores, indices, w1, w2, w3, group_name, schedule, score_before = inputs
    ctx.save_for_backward(x, top_scores, indices, w1, w2, w3)
    ctx.group_name = group_name
    ctx.schedule = schedule
    ctx.score_before = score_before


def _backward(ctx, grad_out: torch.Tensor):
    x, top_scores, indices, w1, w2, w3 = ctx.saved_tensors
    ws = workspace_for(ctx.group_name, x, w1, indices.shape[1], backward=True)
    dx, dscores, dw1, dw2, dw3 = moe_backward(
        grad_out.contiguous(), x, top_scores, indices, w1.contiguous(), w2.contiguous(), w3.contiguous(),
        workspace=ws, schedule=ctx.schedule, score_before_experts=ctx.score_before,
    )
    return dx, dscores.to(top_scores.dtype), None, dw1, dw2, dw3, None, None, None


moe_experts.register_autograd(_backward, setup_context=_setup_context)


def _kernel_schedule(name: str):
    def run(x, routing: Routing, w1, w2, w3, *, group: dist.ProcessGroup, score_before_experts: bool) -> torch.Tensor:
        return torch.ops.uniep.moe_experts(
            x, routing.top_scores, routing.selected_experts_indices, w1, w2, w3,
            group.group_name, name, score_before_experts,
        )

    run.__name__ = f"{name}_schedule"
    return run


register_schedule("sequential", _kernel_schedule("sequential"), needs_cuda=True)
register_schedule("fused", _kernel_schedule("fused"), needs_cuda=True)
