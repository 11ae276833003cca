"""The forward of one MoE layer's routed-expert path on UniEP's kernels.

    route kernels (per-block counts, counts exchange, layout; runtime.launch.route)
    -> dispatch_fc1: dispatch + fc1 (w1, w3) + SwiGLU
    -> fc2_combine: fc2 + combine

``schedule="fused"`` overlaps communication and GEMM tiles inside each
megakernel; ``schedule="sequential"`` launches the same kernels task kind by
task kind (all dispatch, then all fc1; all fc2, then all reduce). Both place
every row by ``titan_uniep.layout`` and run the same compiled tile code, so
their outputs are bitwise equal.

Nothing on the fused path synchronises with the host: buffers are sized for
the worst case (``runtime.workspace``), the kernels read every count on the
device, and errors are polled lazily (``Workspace.poll_errors``). The whole
call can be captured in a CUDA graph (after one eager call has compiled the
kernels).

Shapes (``T`` tokens of this rank, ``D`` dim, ``H`` expert hidden dim, ``K``
experts per token, ``E`` experts, ``El = E / W`` local experts):

- ``x``: ``(T, D)`` bf16 / fp16 / fp32 (the workspace's dtype); ``T`` may be 0.
- ``top_scores``: ``(T, K)`` router scores (fp32, as TorchTitan's router gives).
- ``selected_experts_indices``: ``(T, K)`` int, global expert ids in
  ``[0, E)``, distinct within a token.
- ``w1``, ``w3``: ``(El, H, D)``; ``w2``: ``(El, D, H)`` -- this rank's experts
  in TorchTitan's GroupedExperts layout, the workspace's dtype.
- returns ``(T, D)`` in ``x.dtype``: ``sum_k score[t,k] * FFN_e(x[t])``
  (scores after the experts) or ``sum_k FFN_e(bf16(x[t] * score[t,k]))``
  (before), summed over k = 0..K-1 in fp32.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton

from ..kernels.dispatch_fc1 import dispatch_fc1_kernel, fc1_launch_stages
from ..kernels.fc2_combine import fc2_combine_kernel
from ..kernels.scoreboard import sync_scope
from ..layout import RouteLayout, token_destinations
from ..params import LayerParams
from .launch import (
    CallArrays,
    ErrorCheck,
    KernelSchedule,
    call_params,
    check_layer_inputs,
    check_saved_h13,
    check_schedule,
    error_check_for,
    finish,
    interpreting,
    num_programs,
    precision,
    programs_per_sm,
    rank_tensors,
    route,
    route_world,
    stack_ranks,
    tma_rows,
    use_timer,
    wait_bound,
)
from .workspace import Workspace

__all__ = ["PHASES", "exchange_bytes", "moe_forward", "simulated_moe_forward"]

# Launches of each schedule; a phase joined by "+" is one launch doing both.
PHASES = {"fused": ("dispatch+fc1", "fc2+reduce"), "sequential": ("dispatch", "fc1", "fc2", "reduce")}


def moe_forward(
    x: torch.Tensor,
    top_scores: torch.Tensor,
    selected_experts_indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    workspace: Workspace,
    schedule: KernelSchedule = "fused",
    score_before_experts: bool,
    params: LayerParams | None = None,
    out: torch.Tensor | None = None,
    error_check: ErrorCheck | None = None,
    saved_h13: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts of one MoE layer with real EP (one process per GPU).

    Every rank of ``workspace``'s group must call it, in the same order of
    layers, also with ``T = 0``. Shapes: see the module docstring. ``out``:
    optional preallocated ``(T, D)`` output, contiguous, of any floating dtype
    (the fp32 sum over k is rounded once to it). ``params``: default the
    workspace's (fused == sequential bitwise at every point). ``error_check``:
    ``"sync"`` (check the error record after the launches; a host sync) or
    ``"lazy"`` (poll without syncing, see ``Workspace.poll_errors``); default
    lazy for ``"fused"``, sync for ``"sequential"``. ``saved_h13``: optional
    ``(slot_capacity, 2 * H)`` buffer that receives each slot's h1 and h3
    (rounded; rows of slots this call does not use are left alone), which
    the backward (``runtime.backward.moe_backward(saved_h13=...)``) requires;
    a forward with no backward after it leaves it out.
    """
    if workspace.is_simulated:
        raise ValueError("moe_forward needs a Workspace.for_group workspace; use simulated_moe_forward otherwise")
    p = call_params(workspace, params)
    check_schedule(schedule)
    check = error_check_for(schedule, error_check)
    if check == "lazy":
        workspace.poll_errors()
    check_layer_inputs(workspace, workspace.shape.dim, x, top_scores, selected_experts_indices, w1, w2, w3)
    route(workspace, selected_experts_indices.contiguous().unsqueeze(0), x.shape[0], p)
    if out is None:
        out = torch.empty_like(x)
    call = CallArrays(
        x=x.contiguous().unsqueeze(0), scores=top_scores.to(torch.float32).contiguous().unsqueeze(0),
        w1=w1.contiguous().unsqueeze(0), w2=w2.contiguous().unsqueeze(0), w3=w3.contiguous().unsqueeze(0),
        out=out.unsqueeze(0),
    )
    if saved_h13 is not None:
        check_saved_h13(workspace, saved_h13)
        call.h13 = saved_h13.unsqueeze(0)
    launch_forward(workspace, call, p, score_before_experts, PHASES[schedule])
    finish(workspace, check)
    return out


def simulated_moe_forward(
    xs: Sequence[torch.Tensor] | torch.Tensor,
    scores: Sequence[torch.Tensor] | torch.Tensor,
    indices: Sequence[torch.Tensor] | torch.Tensor,
    w1s: Sequence[torch.Tensor] | torch.Tensor,
    w2s: Sequence[torch.Tensor] | torch.Tensor,
    w3s: Sequence[torch.Tensor] | torch.Tensor,
    *,
    schedule: KernelSchedule = "fused",
    score_before_experts: bool,
    params: LayerParams | None = None,
    workspace: Workspace | None = None,
    out: torch.Tensor | None = None,
    saved_h13: torch.Tensor | None = None,
    error_check: ErrorCheck = "sync",
) -> list[torch.Tensor]:
    """The same forward for a simulated world of ``W`` ranks held in this
    process (CPU interpreter or one GPU): one launch runs every rank.

    Per rank ``r``, as a sequence of ``W`` tensors or one stacked ``(W, ...)``
    tensor: ``xs[r]`` ``(T_r, D)``, ``scores[r]``/``indices[r]`` ``(T_r, K)``,
    ``w1s[r]``/``w3s[r]`` ``(El, H, D)``, ``w2s[r]`` ``(El, D, H)``. Stacked
    weights (and a stacked ``xs``) are read in place; sequences are stacked
    per call (a copy of every rank's weights: pass them stacked to time the
    kernels). A stacked ``xs`` gives every rank the same ``T`` (its rows).
    ``workspace``: a ``Workspace.simulated`` to reuse (built per call if None).
    ``out``: optional ``(W, T_out, D)`` output written in place by the
    kernels (``T_out >= max T_r``; rows past a rank's ``T_r`` left alone),
    of any floating dtype.
    ``saved_h13``: optional ``(W, slot_capacity, 2 * H)``, see ``moe_forward``.
    ``error_check``: ``"sync"`` (check the error record after the launches)
    or ``"lazy"`` (as ``moe_forward``'s: no host sync, for timing loops).
    Returns the ``W`` outputs ``(T_r, D)`` (views of ``out`` when given).
    """
    x_list = rank_tensors(xs, len(xs))
    world = len(x_list)
    score_list, index_list = rank_tensors(scores, world), rank_tensors(indices, world)
    check_schedule(schedule)
    num_tokens = [x.shape[0] for x in x_list]
    w1 = stack_ranks(w1s, None, x_list[0].dtype)
    w2 = stack_ranks(w2s, None, x_list[0].dtype)
    w3 = stack_ranks(w3s, None, x_list[0].dtype)
    if workspace is None:
        _, el, hidden, dim = w1.shape
        workspace = Workspace.simulated(
            world, num_tokens=max(max(num_tokens), 1), dim=dim, hidden=hidden, num_experts=el * world,
            top_k=index_list[0].shape[1], dtype=x_list[0].dtype, device=x_list[0].device, params=params,
        )
    elif not workspace.is_simulated or workspace.world_size != world:
        raise ValueError(f"workspace must be a Workspace.simulated of {world} ranks")
    p = call_params(workspace, params)
    check = error_check_for(schedule, error_check)
    if check == "lazy":
        workspace.poll_errors()
    shape = workspace.shape
    for r in range(world):
        check_layer_inputs(workspace, shape.dim, x_list[r], score_list[r], index_list[r], w1[r], w2[r], w3[r])
    route_world(workspace, index_list, p)
    x = stack_ranks(xs, None, shape.dtype) if isinstance(xs, torch.Tensor) else stack_ranks(x_list, None, shape.dtype)
    if out is None:
        out = torch.empty(world, x.shape[1], shape.dim, dtype=shape.dtype, device=x.device)
    elif (out.dim() != 3 or out.shape[0] != world or out.shape[1] < max(num_tokens) or out.shape[2] != shape.dim
          or not out.dtype.is_floating_point or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous ({world}, >= {max(num_tokens)}, {shape.dim}) floating-point "
                         f"tensor, got {tuple(out.shape)} {out.dtype}")
    call = CallArrays(x=x, scores=stack_ranks(score_list, shape.token_capacity, torch.float32), w1=w1, w2=w2, w3=w3,
                      out=out)
    if saved_h13 is not None:
        check_saved_h13(workspace, saved_h13)
        call.h13 = saved_h13
    launch_forward(workspace, call, p, score_before_experts, PHASES[schedule])
    finish(workspace, check)
    return [out[r, : num_tokens[r]] for r in range(world)]


def exchange_bytes(layout: RouteLayout, dim: int, elem_size: int) -> dict[str, torch.Tensor]:
    """Bytes this rank sends to other ranks in one forward (device scalars).

    ``dispatch_copies``: one row per (token, k) copy (TorchTitan's all-to-all);
    ``dispatch_dedup``: one row per (token, destination rank) (UniEP);
    ``combine``: one row per copy back to its source.
    """
    remote = torch.ones(layout.ep_size, dtype=torch.bool, device=layout.dest_rank.device)
    remote[layout.rank] = False
    copies = layout.send_counts[remote].sum()
    dedup = token_destinations(layout)[:, remote].sum()
    row = dim * elem_size
    return {"dispatch_copies": copies * row, "dispatch_dedup": dedup * row, "combine": copies * row}


def launch_forward(ws: Workspace, call: CallArrays, p: LayerParams, score_before: bool,
                   phases: Sequence[str]) -> None:
    """Launch the forward megakernels for ``phases`` (see ``PHASES``), in order."""
    s = ws.shape
    grid = (num_programs(ws, p),)
    timeout = wait_bound(ws, p)
    h13 = call.h13 if call.h13 is not None else ws.h  # never written unless saving
    if p.debug_race:
        ws.start_race_report(p)
    shape_meta = dict(NUM_LOCAL=ws.num_local_ranks, WORLD=s.world_size, DIM=s.dim, HIDDEN=s.hidden, TOP_K=s.top_k,
                      SCORE_BEFORE=score_before, GROUP_M=p.group_m, PRECISION=precision(ws), USE_TIMER=use_timer(ws),
                      RACE=p.debug_race, SLACK=p.debug_wait_slack, SCOPE=sync_scope(ws.num_local_ranks, s.world_size))

    def dispatch_fc1(do_dispatch: int, do_fc1: int, dispatch_programs: int) -> None:
        dispatch_fc1_kernel[grid](
            call.x, call.x.stride(0), call.scores, ws.route_args, call.w1, call.w3, call.w1.stride(0),
            ws.h, ws.h.stride(0), h13, h13.stride(0), ws.control, ws.arena_args, ws.anchor_rank, ws.rank_base,
            do_dispatch, do_fc1, dispatch_programs, p.debug_silent_rank, timeout, int(p.local_first),
            BM=p.block_m, BN=p.fc1_block_n, BK=p.fc1_block_k, BT=p.dispatch_block_tokens, BD=p.dispatch_block_dim,
            KP=triton.next_power_of_2(s.top_k), SAVE_H13=call.h13 is not None,
            ONE_DOT=p.fc1_one_dot and not score_before, num_warps=p.fc1_num_warps,
            num_stages=fc1_launch_stages(p.fc1_num_stages, score_before),
            **shape_meta,
        )

    grid_b = (grid[0] * programs_per_sm(ws, p.fc2_programs_per_sm),)
    b_rows = tma_rows(ws, ws.h, call.w2) if p.fc2_tma else None
    b_opts = dict(num_warps=p.fc2_num_warps, num_stages=p.fc2_num_stages)
    if p.fc2_max_registers is not None:
        b_opts["maxnreg"] = p.fc2_max_registers

    def fc2_combine(do_fc2: int, do_reduce: int) -> None:
        fc2_combine_kernel[grid_b](
            ws.h, ws.h.stride(0), call.w2, call.w2.stride(0), call.scores, ws.route_args, call.out,
            call.out.stride(0), ws.control, ws.arena_args, ws.anchor_rank, ws.rank_base,
            do_fc2, do_reduce, timeout, *(b_rows or (0, 0)),
            BM=p.block_m, BN=p.fc2_block_n, BK=p.fc2_block_k, BT=p.reduce_block_tokens, BD=p.reduce_block_dim,
            DEFER_RELEASE=p.fc2_defer_release, TMA=b_rows is not None, FLAT=p.fc2_flat_loop,
            INTERPRET=interpreting(), **b_opts, **shape_meta,
        )

    for phase in phases:
        if phase == "dispatch+fc1":
            dispatch_fc1(1, 1, p.dispatch_programs)
        elif phase == "dispatch":
            dispatch_fc1(1, 0, grid[0])
        elif phase == "fc1":
            dispatch_fc1(0, 1, 0)
        elif phase == "fc2+reduce":
            fc2_combine(1, 1)
        elif phase == "fc2":
            fc2_combine(1, 0)
        elif phase == "reduce":
            fc2_combine(0, 1)
        else:
            raise ValueError(f"unknown phase {phase!r}")
