"""The backward of one MoE layer's routed-expert path on UniEP's kernels.

Given the forward's inputs and the output gradient, on the same
deterministic layout as the forward:

    route kernels (the forward's, on the backward workspace: the same slots)
    -> dispatch_dh: dispatch [x | dOut] + dH tiles (G = dOut @ w2)
    -> SwiGLU backward pass: h, dh1, dh3 per slot from G and the saved h1 | h3,
       and the router-score partials <G, h> when scores come after the experts
    -> da_combine: dA = dh1 @ w1 + dh3 @ w3 sent back and combined over k
       (dx, router-score grads)
    -> wgrad (no communication): each slot's x and dOut rows in dense slot
       order (copied by the dH tasks with ``LayerParams.dh_copies_rows``,
       else by a gather launch), then per
       expert over all its rows: ``torch._grouped_mm`` on the GPU in bf16,
       the Triton kernel elsewhere and for fp32 gradients of 16-bit data
       (``LayerParams.wgrad_backend``)

What is kept between forward and backward: the op's inputs (x, scores,
indices, weights) and each slot's h1 and h3, which the forward wrote into the
``saved_h13`` buffer (``slot_capacity x 2H`` in the activation dtype, as
TorchTitan's autograd keeps them); the backward requires that buffer. x is
dispatched again next to dOut (one ``2 * D`` row per token and destination
rank) for dW1/dW3; h is rebuilt from h1 and h3. The router-score gradient
``<dOut, y>`` needs no second fc2 (``= <dOut @ w2, h>``).

``schedule="sequential"`` launches every task kind separately (dispatch, dH
tiles, SwiGLU pass, dA tiles, weight grads, reduce); ``"fused"`` runs dispatch
and dH tiles in one persistent grid, then the SwiGLU pass, then dA tiles and
reduce in another, then the weight grads. Same layout, same compiled tiles:
every gradient is bitwise equal between the schedules and run to run.
Nothing syncs with the host (errors are polled lazily, as in the forward).

Shapes as the forward (``runtime.forward``): ``grad_out``, ``x`` ``(T, D)`` in
the workspace dtype; ``top_scores`` ``(T, K)`` fp32; ``indices`` ``(T, K)``
int, distinct per token; ``w1``, ``w3`` ``(El, H, D)``, ``w2`` ``(El, D, H)``.
Returns ``dx (T, D)`` (x.dtype), ``dscores (T, K)`` fp32, ``dw1``, ``dw2``,
``dw3`` (the weights' shapes, accumulated in fp32, experts with no rows get
zeros) in the weights' dtype, or in ``weight_grad_dtype = torch.float32``:
the GEMM's fp32 sums stored as they are, for fp32 master weights of which
the 16-bit weights are casts (no 16-bit rounding, no widening copy; the
Triton kernel, which ``torch._grouped_mm`` cannot replace: its output takes
its operands' dtype).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton

from ..kernels.da_combine import da_combine_kernel
from ..kernels.dispatch_dh import dispatch_dh_kernel, swiglu_backward_kernel
from ..kernels.route import ROW_EXPERT_BASE, ROW_ROWS
from ..kernels.scoreboard import sync_scope
from ..kernels.wgrad import gather_slot_rows_kernel, wgrad_kernel
from ..params import WGRAD_BACKENDS, LayerParams
from .launch import (
    CallArrays,
    ErrorCheck,
    KernelSchedule,
    call_params,
    check_layer_inputs,
    check_saved_h13,
    check_schedule,
    ensure_tma_allocator,
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
    widen_to_float32,
)
from .workspace import BackwardWorkspace

__all__ = ["GROUPED_MM_MAX_GROUPS", "PHASES", "moe_backward", "simulated_moe_backward", "wgrad_backend"]

# Launches of each schedule; "+" joins task kinds run by one persistent grid.
PHASES = {
    "fused": ("dispatch+dh", "swiglu", "da+reduce", "wgrad"),
    "sequential": ("dispatch", "dh", "swiglu", "da", "wgrad", "reduce"),
}

# torch's sm_90 bf16 grouped GEMM (CUTLASS, grouped mode: each output tile
# reduces over its group's whole K, no split-K) takes fewer than 1024 groups.
GROUPED_MM_MAX_GROUPS = 1023


def moe_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    top_scores: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    workspace: BackwardWorkspace,
    schedule: KernelSchedule = "fused",
    score_before_experts: bool,
    params: LayerParams | None = None,
    error_check: ErrorCheck | None = None,
    saved_h13: torch.Tensor | None = None,
    weight_grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``runtime.forward.moe_forward`` with real EP (one process per GPU).

    Every rank of the group calls it in the same layer order (also with
    T = 0). Returns ``(dx, dscores, dw1, dw2, dw3)``, see the module docstring.
    ``params``: default the workspace's. ``error_check``: as ``moe_forward``.
    ``saved_h13`` (required): the ``(slot_capacity, 2 * H)`` buffer the
    forward filled with each slot's h1 | h3 (``moe_forward(saved_h13=...)``,
    same inputs and routing). ``weight_grad_dtype``: dW1, dW2, dW3's dtype
    (default the weights'; ``torch.float32``: see the module docstring).
    """
    if workspace.is_simulated:
        raise ValueError("moe_backward needs a BackwardWorkspace.for_group; use simulated_moe_backward otherwise")
    _require_saved(saved_h13, "moe_backward", "runtime.forward.moe_forward")
    ws = workspace.inner
    p = _backward_params(workspace, params)
    check_schedule(schedule)
    check = error_check_for(schedule, error_check)
    if check == "lazy":
        ws.poll_errors()
    check_layer_inputs(ws, workspace.dim, x, top_scores, indices, w1, w2, w3, grad_out)
    check_saved_h13(ws, saved_h13)
    route(ws, indices.contiguous().unsqueeze(0), x.shape[0], p)
    u = lambda t: t.contiguous().unsqueeze(0)  # noqa: E731
    call = CallArrays(x=u(x), grad_out=u(grad_out), scores=u(top_scores.to(torch.float32)), w1=u(w1), w2=u(w2),
                      w3=u(w3), h13=saved_h13.unsqueeze(0))
    grads = launch_backward(workspace, call, p, score_before_experts, PHASES[schedule],
                            grad_dtype=_weight_grad_dtype(weight_grad_dtype, w1.dtype))
    finish(ws, check)
    return tuple(g[0] for g in grads)


def simulated_moe_backward(
    grad_outs: Sequence[torch.Tensor] | torch.Tensor,
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
    workspace: BackwardWorkspace | None = None,
    poison_outputs: bool = False,
    saved_h13: torch.Tensor | None = None,
    error_check: ErrorCheck = "sync",
    weight_grad_dtype: torch.dtype | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """The backward for a simulated world of ``W`` ranks in this process (CPU
    interpreter or one GPU); arguments per rank as
    ``runtime.forward.simulated_moe_forward`` (sequences or stacked tensors;
    stacked weights are read in place) plus ``grad_outs[r]`` ``(T_r, D)``,
    laid out as ``xs``. Returns one ``(dx, dscores, dw1, dw2, dw3)`` per rank.
    ``poison_outputs`` (tests): fill the outputs with NaN before the launches,
    so an element no task writes shows up. ``saved_h13`` (required):
    ``(W, slot_capacity, 2 * H)`` filled by ``simulated_moe_forward(saved_h13=...)``
    on the same inputs. ``weight_grad_dtype``: as ``moe_backward``'s."""
    _require_saved(saved_h13, "simulated_moe_backward", "runtime.forward.simulated_moe_forward")
    x_list = rank_tensors(xs, len(xs))
    world = len(x_list)
    g_list = rank_tensors(grad_outs, world)
    score_list, index_list = rank_tensors(scores, world), rank_tensors(indices, world)
    check_schedule(schedule)
    num_tokens = [x.shape[0] for x in x_list]
    dtype = x_list[0].dtype
    w1, w2, w3 = (stack_ranks(w, None, dtype) for w in (w1s, w2s, w3s))
    if workspace is None:
        _, el, hidden, dim = w1.shape
        workspace = BackwardWorkspace.simulated(
            world, num_tokens=max(max(num_tokens), 1), dim=dim, hidden=hidden, num_experts=el * world,
            top_k=index_list[0].shape[1], dtype=dtype, device=x_list[0].device, params=params,
        )
    elif not workspace.is_simulated or workspace.world_size != world:
        raise ValueError(f"workspace must be a BackwardWorkspace.simulated of {world} ranks")
    ws = workspace.inner
    p = _backward_params(workspace, params)
    check = error_check_for(schedule, error_check)
    if check == "lazy":
        ws.poll_errors()
    for r in range(world):
        check_layer_inputs(ws, workspace.dim, x_list[r], score_list[r], index_list[r], w1[r], w2[r], w3[r], g_list[r])
    check_saved_h13(ws, saved_h13)
    route_world(ws, index_list, p)
    stacked = isinstance(xs, torch.Tensor) and isinstance(grad_outs, torch.Tensor)
    x = stack_ranks(xs if stacked else x_list, None, dtype)
    g = stack_ranks(grad_outs if stacked else g_list, x.shape[1], dtype)
    call = CallArrays(x=x, grad_out=g, scores=stack_ranks(score_list, ws.shape.token_capacity, torch.float32),
                      w1=w1, w2=w2, w3=w3, h13=saved_h13)
    dx, ds, dw1, dw2, dw3 = launch_backward(workspace, call, p, score_before_experts, PHASES[schedule],
                                            poison=poison_outputs,
                                            grad_dtype=_weight_grad_dtype(weight_grad_dtype, dtype))
    finish(ws, check)
    return [(dx[r, :num_tokens[r]], ds[r, :num_tokens[r]], dw1[r], dw2[r], dw3[r]) for r in range(world)]


def wgrad_backend(requested: str, dtype: torch.dtype, device: torch.device, num_local_experts: int = 1,
                  grad_dtype: torch.dtype | None = None) -> str:
    """The weight-gradient backend that runs for ``requested`` (``LayerParams.wgrad_backend``)
    on ``dtype`` data, the gradients in ``grad_dtype`` (default ``dtype``).
    ``"auto"`` takes ``torch._grouped_mm`` where it runs and writes the
    gradients' dtype (bf16), else the Triton kernel; an explicit
    ``"grouped_mm"`` with fp32 gradients widens its bf16 output."""
    if requested not in WGRAD_BACKENDS:
        raise ValueError(f"wgrad backend must be one of {WGRAD_BACKENDS}, got {requested!r}")
    grouped = (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
               and num_local_experts <= GROUPED_MM_MAX_GROUPS and torch.cuda.get_device_capability(device)[0] >= 9)
    if requested == "grouped_mm" and not grouped:
        raise ValueError("wgrad backend 'grouped_mm' needs bf16 data on a CUDA GPU of compute capability 9.0+, "
                         f"torch._grouped_mm and at most {GROUPED_MM_MAX_GROUPS} local experts "
                         f"(got {dtype}, {device}, {num_local_experts} local experts)")
    if requested == "auto":
        return "grouped_mm" if grouped and grad_dtype in (None, dtype) else "triton"
    return requested


def _weight_grad_dtype(requested: torch.dtype | None, dtype: torch.dtype) -> torch.dtype:
    """The weight gradients' dtype: ``dtype`` (the data's) or fp32."""
    if requested is None or requested == dtype:
        return dtype
    if requested != torch.float32:
        raise ValueError(f"weight_grad_dtype must be the weights' dtype ({dtype}) or torch.float32, got {requested}")
    return requested


def wgrad_stages(ws, stages: int, stage_bytes: int) -> int:
    """The Triton weight-gradient kernel's pipelining depth on this device: at
    most ``stages``, and shallow enough that its operand buffers fit one
    program's shared memory (Triton keeps ``stages - 1`` K steps of the A and
    B tiles in flight; with fp32 data, which ``torch._grouped_mm`` does not
    take, the 16-bit defaults need twice the bytes). A schedule choice: the
    depth never changes a bit."""
    if ws.device.type != "cuda" or interpreting():
        return stages
    props = torch.cuda.get_device_properties(ws.device)
    limit = getattr(props, "shared_memory_per_block_optin", 0) or 232448
    while stages > 2 and (stages - 1) * stage_bytes > limit - 4096:
        stages -= 1
    return stages


def dh_max_registers(p: LayerParams) -> int | None:
    """Register cap of dispatch_dh: its dH tile is a plain GEMM tile that fits
    ``dh_programs_per_sm`` programs of ``dh_num_warps`` warps per SM in 128
    registers, which ptxas does not aim for by itself (the dispatch loops and
    the slot-row copy take it past that)."""
    if p.dh_programs_per_sm <= 1:
        return None
    return 65536 // (32 * p.dh_num_warps * p.dh_programs_per_sm) // 8 * 8


def da_reduce_dim(p: LayerParams, score_before: bool) -> int:
    """Columns per step of da_combine's reduce: ``reduce_block_dim``, at most
    256 with scores before the experts (that reduce also reads x rows, for
    the score gradient; at 512 ptxas spills in the 4-warp short-K da_combine)."""
    return min(p.reduce_block_dim, 256) if score_before else p.reduce_block_dim


# ---- internals ------------------------------------------------------------


def _require_saved(saved_h13: torch.Tensor | None, caller: str, forward: str) -> None:
    """The backward reads h1 | h3 from the forward's buffer (it has no path that recomputes them)."""
    if saved_h13 is None:
        raise ValueError(f"{caller} needs saved_h13, each slot's h1 | h3 from the forward: run the forward "
                         f"({forward}) with saved_h13=BUFFER on the same inputs and pass the same BUFFER here")


def _backward_params(bws: BackwardWorkspace, params: LayerParams | None) -> LayerParams:
    return call_params(bws.inner, params)


def _gather_slot_rows(bws: BackwardWorkspace, call: CallArrays, score_before: bool) -> None:
    """Each used slot's x (times the score, scores before the experts) and
    dOut rows, dense in slot order (``bws.slot_rows``)."""
    ws = bws.inner
    s = ws.shape
    block_s = 16
    gather_slot_rows_kernel[(triton.cdiv(s.slot_capacity, block_s), ws.num_local_ranks)](
        bws.slot_rows, ws.route_tables, call.x, call.grad_out, call.x.stride(0), ws.arena_args, ws.anchor_rank,
        ws.rank_base, WORLD=s.world_size, DIM=bws.dim, TOP_K=s.top_k, NUM_EXPERTS_LOCAL=s.num_local_experts,
        NUM_EXPERTS=s.num_experts, SCORE_BEFORE=score_before, BS=block_s, BD=min(512, triton.next_power_of_2(bws.dim)),
        num_warps=4,
    )


def _weight_grads(bws: BackwardWorkspace, call: CallArrays, p: LayerParams, score_before: bool, poison: bool,
                  rows_copied: bool, grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dW1, dW2, dW3 ``(L, El, ...)`` in ``grad_dtype`` of every local rank: the
    dense slot rows (unless dispatch_dh wrote them: ``rows_copied``), then the
    per-expert GEMMs (``kernels.wgrad``)."""
    ws = bws.inner
    s = ws.shape
    dim, hidden, num_local, el = bws.dim, s.hidden, ws.num_local_ranks, s.num_local_experts
    rows = bws.slot_rows
    if not rows_copied:
        _gather_slot_rows(bws, call, score_before)
    xs, dys = rows[:, 0], rows[:, 1]
    h, dh1, dh3 = ws.h, bws.dh1, bws.dh3
    if wgrad_backend(p.wgrad_backend, s.dtype, ws.device, el, grad_dtype) == "grouped_mm":
        # Each expert's slots are [base, base + rows), back to back in expert
        # order: the groups' end offsets; rows past the last are not read.
        tables = ws.route_tables
        grads = ([], [], [])
        for local in range(num_local):
            first = (ws.rank_base + local) * el
            ends = (tables[local, ROW_EXPERT_BASE, first:first + el] + tables[local, ROW_ROWS, first:first + el])
            ends = ends.to(torch.int32)
            grads[0].append(torch._grouped_mm(dh1[local].t(), xs[local], offs=ends))
            grads[1].append(torch._grouped_mm(dys[local].t(), h[local], offs=ends))
            grads[2].append(torch._grouped_mm(dh3[local].t(), xs[local], offs=ends))
        stacked = (g[0].unsqueeze(0) if num_local == 1 else torch.stack(g) for g in grads)
        return tuple(g if g.dtype == grad_dtype else widen_to_float32(g) for g in stacked)

    dw1, dw2, dw3 = (torch.empty(w.shape, dtype=grad_dtype, device=w.device) for w in (call.w1, call.w2, call.w3))
    if poison:
        for out in (dw1, dw2, dw3):
            out.fill_(float("nan"))
    # Tensor descriptors for 16-bit data on the GPU (wgmma reads the
    # transposed A operand from shared memory only for 16-bit types).
    tma = ws.device.type == "cuda" and s.elem_size == 2 and dim % 8 == 0 and hidden % 8 == 0
    if tma:
        ensure_tma_allocator()

    def gemm(a1, a2, b, out1, out2, m, n, tiles, two):
        bm, bn, bk, warps, stages = tiles
        stages = wgrad_stages(ws, stages, ((2 if two else 1) * bm * bk + bk * bn) * s.elem_size)
        grid = (el * triton.cdiv(m, bm) * triton.cdiv(n, bn), num_local)
        wgrad_kernel[grid](
            a1, a2, a1.stride(1), a1.stride(0), b, b.stride(1), b.stride(0), ws.route_tables, out1, out2,
            ws.rank_base, M=m, N=n, NUM_EXPERTS_LOCAL=el, NUM_EXPERTS=s.num_experts, BM=bm, BN=bn, BK=bk,
            GROUP=8, TWO_A=two, TMA=tma, STAGES=stages, PRECISION=precision(ws), INTERPRET=interpreting(),
            num_warps=warps, num_stages=stages,
        )

    gemm(dh1, dh3, xs, dw1, dw3, hidden, dim, (p.wgrad_w13_block_m, p.wgrad_w13_block_n, p.wgrad_w13_block_k,
                                               p.wgrad_w13_num_warps, p.wgrad_w13_num_stages), True)
    gemm(dys, dys, h, dw2, dw2, dim, hidden, (p.wgrad_w2_block_m, p.wgrad_w2_block_n, p.wgrad_w2_block_k,
                                              p.wgrad_w2_num_warps, p.wgrad_w2_num_stages), False)
    return dw1, dw2, dw3


def launch_backward(bws: BackwardWorkspace, call: CallArrays, p: LayerParams, score_before: bool,
                    phases: Sequence[str], poison: bool = False, grad_dtype: torch.dtype | None = None):
    """Launch the backward kernels for ``phases`` (see ``PHASES``), in order;
    returns ``(dx, dscores, dw1, dw2, dw3)`` stacked on the local ranks, the
    weight gradients in ``grad_dtype`` (default the weights')."""
    grad_dtype = grad_dtype or call.w1.dtype
    ws = bws.inner
    s = ws.shape
    dim, hidden, top_k = bws.dim, s.hidden, s.top_k
    grid = (num_programs(ws, p),)
    timeout = wait_bound(ws, p)
    col_blocks_dh = triton.cdiv(hidden, p.dh_block_n)
    ds_parts = bws.ds_parts_for(col_blocks_dh)
    dx = torch.empty_like(call.x)
    ds = torch.empty(call.scores.shape, dtype=torch.float32, device=dx.device)
    dws = None
    if poison:
        for out in (dx, ds):
            out.fill_(float("nan"))
    h = ws.h
    h13 = call.h13
    g32 = bws.g32
    if p.debug_race:
        ws.start_race_report(p)
    shape_meta = dict(NUM_LOCAL=ws.num_local_ranks, WORLD=s.world_size, DIM=dim, HIDDEN=hidden, TOP_K=top_k,
                      KP=triton.next_power_of_2(top_k), SCORE_BEFORE=score_before, GROUP_M=p.group_m,
                      BT=p.reduce_block_tokens, PRECISION=precision(ws), USE_TIMER=use_timer(ws),
                      RACE=p.debug_race, SLACK=p.debug_wait_slack,
                      SCOPE=sync_scope(ws.num_local_ranks, s.world_size))

    # The dH tile is a plain GEMM tile (128 registers): two programs per SM
    # let one's fp32 G stores overlap the other's K-loop. (Every program
    # dispatches before it takes a tile, so programs that are not resident
    # yet cannot hold up a waiting tile.)
    grid_dh = (grid[0] * programs_per_sm(ws, p.dh_programs_per_sm),)
    copy_rows = p.dh_copies_rows
    dh_opts = dict(num_warps=p.dh_num_warps, num_stages=p.dh_num_stages)
    cap = dh_max_registers(p)
    if ws.device.type == "cuda" and cap is not None:
        dh_opts["maxnreg"] = cap

    def dispatch_dh(do_dispatch: int, do_tiles: int, dispatch_programs: int) -> None:
        dispatch_dh_kernel[grid_dh](
            call.x, call.grad_out, call.x.stride(0), call.scores, ws.route_args, call.w2, call.w2.stride(0), g32,
            g32.stride(0), bws.slot_rows, bws.slot_rows.stride(0), ws.control, ws.arena_args, ws.anchor_rank,
            ws.rank_base, do_dispatch, do_tiles, dispatch_programs, p.debug_silent_rank, timeout, int(p.local_first),
            BM=p.block_m, BN=p.dh_block_n, BK=p.dh_block_k, BD=p.dispatch_block_dim, COPY_ROWS=copy_rows,
            BDC=min(64, triton.next_power_of_2(dim)), **{**shape_meta, "BT": p.dispatch_block_tokens}, **dh_opts,
        )

    grid_da = (grid[0] * programs_per_sm(ws, p.da_programs_per_sm),)
    da_opts = dict(num_warps=p.da_num_warps, num_stages=p.da_num_stages)
    da_rows = tma_rows(ws, bws.dh1, call.w1) if p.da_tma and hidden % p.da_block_k == 0 else None
    if p.da_max_registers is not None:
        da_opts["maxnreg"] = p.da_max_registers
    elem = s.elem_size

    def da_combine(do_tiles: int, do_reduce: int) -> None:
        da_combine_kernel[grid_da](
            bws.dh1, bws.dh3, h.stride(0), call.w1, call.w3, call.w1.stride(0), ds_parts, ds_parts.stride(0),
            call.scores, ws.route_args, call.x, call.x.stride(0), dx, ds, ws.control, ws.arena_args,
            ws.anchor_rank, ws.rank_base, do_tiles, do_reduce, timeout, *(da_rows or (0, 0)),
            BM=p.block_m, BN=p.da_block_n, BK=p.da_block_k, NHB=col_blocks_dh,
            NHBP=triton.next_power_of_2(col_blocks_dh), BD=da_reduce_dim(p, score_before),
            RET_ROW=s.returned_row_elems, RET_ROW_F32=s.returned_row_elems * elem // 4, PARTS_AT_F32=dim * elem // 4,
            TMA=da_rows is not None,
            INTERPRET=interpreting(), **shape_meta, **da_opts,
        )

    for phase in phases:
        if phase == "dispatch+dh":
            # Every program dispatches first: a dH tile waits for rows from every
            # source, so tiles started early would only spin. With local_first
            # every program dispatches the rows that stay on its rank, then the
            # first dispatch_programs send the others while the rest start on
            # the tiles holding only own rows.
            dispatch_dh(1, 1, min(p.dispatch_programs, grid_dh[0]) if p.local_first else grid_dh[0])
        elif phase == "dispatch":
            dispatch_dh(1, 0, grid_dh[0])
        elif phase == "dh":
            dispatch_dh(0, 1, 0)
        elif phase == "swiglu":
            block_s = 32
            swiglu_backward_kernel[(triton.cdiv(s.slot_capacity, block_s), col_blocks_dh, ws.num_local_ranks)](
                g32, h13, h13.stride(0), h, bws.dh1, bws.dh3, h.stride(0), ds_parts, ds_parts.stride(0),
                ws.route_tables, ws.arena_args, ws.anchor_rank, ws.rank_base,
                HIDDEN=hidden, NUM_EXPERTS_LOCAL=s.num_local_experts, NUM_EXPERTS=s.num_experts,
                SCORE_BEFORE=score_before, BS=block_s, BN=p.dh_block_n, num_warps=4,
            )
        elif phase == "da+reduce":
            da_combine(1, 1)
        elif phase == "da":
            da_combine(1, 0)
        elif phase == "wgrad":
            # (Race mode leaves rows undelivered on purpose: no weight gradients of them.)
            if not p.debug_race:
                dws = _weight_grads(bws, call, p, score_before, poison, copy_rows, grad_dtype)
        elif phase == "reduce":
            da_combine(0, 1)
        else:
            raise ValueError(f"unknown phase {phase!r}")
    if dws is None:  # phases without the weight gradients (tests of single phases)
        dws = tuple(torch.full_like(w, float("nan"), dtype=grad_dtype) for w in (call.w1, call.w2, call.w3))
    dw1, dw2, dw3 = dws
    return dx, ds, dw1, dw2, dw3
