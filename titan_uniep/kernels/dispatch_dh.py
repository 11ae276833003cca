"""dispatch_dh (backward megakernel BA): dispatch ``[x | dOut]`` + the dH tiles,
and the SwiGLU backward pass that follows them on the h1 | h3 the forward saved.

Same layout, tiles and scoreboard as the forward (``dispatch_fc1``); the
backward has its own workspace whose token rows are ``2 * D`` wide:
``[x | dOut]`` of one source token, so one de-duplicated row copy carries
both the saved input and the output gradient.

Index arrays (``L`` local ranks, stacked as in the forward):

- ``route`` (``scoreboard.Route``), written by the forward's route kernels run
  on the backward workspace (the same slots as the forward);
- source side: ``x``/``grad_out`` ``(L, T, D)``, ``scores`` ``(L, T_cap, K)``;
- arena (every rank): ``tokens`` ``(W * T_cap, 2D)`` (``[x | dOut]`` rows;
  empty with one rank, where the tiles read x and dOut in place),
  ``slot_copy``/``slot_score`` ``(S,)``, ``tile_arrivals`` ``(C,)``;
- local: ``h``, ``dh1``, ``dh3`` ``(L, S, H)``; ``ds_parts`` ``(L, S, NHB)``
  fp32, one router-score partial per slot and dH column block; ``g32``
  ``(L, S, H)`` fp32 and ``h13`` ``(L, S, 2H)`` with the saved h1 | h3;
  ``slot_rows`` ``(L, 2, S, D)``: the weight gradients' dense operands.

Tasks of ``dispatch_dh_kernel``:

1. dispatch (``scoreboard.dispatch_tasks`` with two-part rows): copy each
   token's ``[x | dOut]`` row once to every rank owning one of its experts,
   write slot entries, release one arrival per copy on its tile;
2. dH tile (expert rows ``m0..m1`` x ``dh_block_n`` columns of H): wait
   (bounded) for the tile's rows (``tile_arrivals``), then ``G = dOut @ w2``
   (the dispatched, unscaled rows), stored in fp32; with ``dh_copies_rows``
   the task also copies one column chunk of its slots' x and dOut rows into
   ``slot_rows``. ``swiglu_backward_kernel`` then runs the SwiGLU backward as
   a streaming pass over G and the saved h1 | h3.

SwiGLU backward (``_swiglu_grad``): ``dH = s * G`` (scores after the experts)
or ``G`` (before); stores ``h`` (``s * h`` after the experts: the weight
gradient takes ``dW2 = dOut^T (s * h)``), ``dh1 = dH * h3 * silu'(h1)``,
``dh3 = dH * silu(h1)`` with torch autograd's rounding steps; scores after the
experts, also the router-score partial ``sum_n G[:, n] * h[:, n]`` over the
tile's columns (``<dOut, y> = <dOut @ w2, h>`` for ``y = h @ w2^T``: no
second fc2).

Sequential schedule: the kernel once with dispatch tasks only, once with dH
tiles only. Same binaries, same tiles, same slots: bitwise equal gradients.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .route import used_slots
from .scoreboard import (
    CTL_TILE_TASKS,
    arena_ptr,
    claim_task,
    dispatch_tasks,
    gemm_tile_task,
    max_over_ranks,
    token_rows_of,
)
from .wgrad import copy_slot_rows

_CTL_DH_TASKS = tl.constexpr(CTL_TILE_TASKS)


@triton.jit
def _swiglu_grad(acc_dh, gate_lp, up_lp, score, offs_m, mask_m, offs_n, mask_n, h, dh1, dh3, ds_parts, col_block,
                 HIDDEN: tl.constexpr, NHB: tl.constexpr, SCORE_BEFORE: tl.constexpr):
    """SwiGLU backward of one block of slots x columns from ``G = dOut @ w2``
    (fp32 ``acc_dh``) and the rounded ``h1``/``h3`` (``gate_lp``/``up_lp``):
    stores h (``s * h`` scores after), dh1, dh3 and the block's router-score
    partials (scores after)."""
    out_ty = h.dtype.element_ty
    # Rounding as torch autograd of TorchTitan's expert: every GEMM output and
    # every elementwise result in the activation dtype, math in fp32. Values
    # stay in the activation dtype between steps (fewer live registers).
    if SCORE_BEFORE:
        grad_lp = acc_dh.to(out_ty)
    else:
        grad_lp = (acc_dh * score[:, None]).to(out_ty)
    gate = gate_lp.to(tl.float32)
    act_lp = (gate / (1.0 + tl.exp(-gate))).to(out_ty)
    hidden = (act_lp.to(tl.float32) * up_lp.to(tl.float32)).to(out_ty)
    at = offs_m[:, None].to(tl.int64) * HIDDEN + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if not SCORE_BEFORE:
        # ds[t, k] = <dOut, y> = <dOut @ w2, h>: this column block's share, in fp32.
        part = tl.sum(tl.where(mask, acc_dh * hidden.to(tl.float32), 0.0), axis=1)
        tl.store(ds_parts + offs_m.to(tl.int64) * NHB + col_block, part, mask=mask_m)
        # dW2 = (s * dOut)^T h is taken as dOut^T (s * h): the weight-gradient
        # loop then feeds both operands to the tensor cores unmodified.
        hidden = (hidden.to(tl.float32) * score[:, None]).to(out_ty)
    tl.store(h + at, hidden, mask=mask)
    grad = grad_lp.to(tl.float32)
    tl.store(dh3 + at, (grad * act_lp.to(tl.float32)).to(out_ty), mask=mask)
    grad_act = (grad * up_lp.to(tl.float32)).to(out_ty).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    tl.store(dh1 + at, (grad_act * (sig * (1.0 + gate * (1.0 - sig)))).to(out_ty), mask=mask)


@triton.jit
def grad_hidden_tile(
    dy_rows, slot_copy, w2, g32, m0, m1, col_block, DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
    ROW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    """``G = dOut @ w2`` in fp32 (``g32`` ``(S, H)``) at slots ``m0..m1``,
    columns ``col_block * BN + [0, BN)`` of one expert (``w2``: its (D, H)):
    token row ``r``'s dOut at ``dy_rows + r * ROW`` (``token_rows_of``: the
    second half of the dispatched ``[x | dOut]`` rows, or dOut in place).
    The K-loop over D has a compile-time trip count and advancing pointers
    (software-pipelined: the gathered rows and the w2 tiles are async
    copies). ``swiglu_backward_kernel`` then does the rest with the saved
    h1 | h3 (an epilogue here would be a streaming pass at a fraction of the
    memory bandwidth, with nothing to overlap it)."""
    EVEN_K: tl.constexpr = DIM % BK == 0
    EVEN_N: tl.constexpr = HIDDEN % BN == 0
    offs_m = m0 + tl.arange(0, BM)
    mask_m = offs_m < m1
    offs_n = col_block * BN + tl.arange(0, BN)
    mask_n = offs_n < HIDDEN
    offs_k = tl.arange(0, BK)
    copy_id = tl.load(slot_copy + offs_m, mask=mask_m, other=0, cache_modifier=".cg")
    token_row = (copy_id // TOP_K).to(tl.int64)
    dy_ptrs = dy_rows + token_row[:, None] * ROW + offs_k[None, :]
    b2_ptrs = w2 + offs_k[:, None].to(tl.int64) * HIDDEN + offs_n[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(DIM, BK)):
        if EVEN_K:
            dy = tl.load(dy_ptrs, mask=mask_m[:, None], other=0.0, cache_modifier=".cg")
            if EVEN_N:
                b2 = tl.load(b2_ptrs)
            else:
                b2 = tl.load(b2_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < DIM - k * BK
            dy = tl.load(dy_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0, cache_modifier=".cg")
            b2 = tl.load(b2_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(dy, b2, acc, input_precision=PRECISION)
        dy_ptrs += BK
        b2_ptrs += BK * HIDDEN
    at = offs_m[:, None].to(tl.int64) * HIDDEN + offs_n[None, :]
    tl.store(g32 + at, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["anchor_rank", "rank_base", "do_dispatch", "do_tiles", "num_dispatch_programs",
                               "silent_rank", "timeout", "local_first"])
def dispatch_dh_kernel(
    x_ptr,  # (L, T, D) saved forward input
    g_ptr,  # (L, T, D) output gradient
    x_rank_stride,
    scores_ptr,  # (L, T_cap, K) fp32
    route,  # scoreboard.Route
    w2_ptr,  # (L, El, D, H)
    weight_rank_stride,
    g32_ptr,  # (L, S, H) fp32 out: G = dOut @ w2 per slot
    g32_rank_stride,
    slot_rows_ptr,  # (L, 2, S, D) out: dense [xs, dys] slot rows (COPY_ROWS; any pointer otherwise)
    slot_rows_rank_stride,
    control_ptr,  # (L, CONTROL_WORDS) int64
    arena,  # scoreboard.Arena
    anchor_rank,
    rank_base,
    do_dispatch,
    do_tiles,
    num_dispatch_programs,
    silent_rank,  # LayerParams.debug_silent_rank
    timeout,
    local_first,  # LayerParams.local_first
    NUM_LOCAL: tl.constexpr, WORLD: tl.constexpr, DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
    KP: tl.constexpr,  # next power of two >= TOP_K
    SCORE_BEFORE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
    USE_TIMER: tl.constexpr, COPY_ROWS: tl.constexpr = False, BDC: tl.constexpr = 64,
    RACE: tl.constexpr = False,  # LayerParams.debug_race (testing only; scoreboard: race mode)
    SLACK: tl.constexpr = 0,  # LayerParams.debug_wait_slack (testing only)
    SCOPE: tl.constexpr = "sys",  # scoreboard.sync_scope
):
    ROW: tl.constexpr = 2 * DIM if WORLD > 1 else DIM  # token_rows_of's stride
    if do_dispatch != 0:
        dispatch_tasks(control_ptr, x_ptr, g_ptr, x_rank_stride, scores_ptr, route, arena, anchor_rank, rank_base,
                       silent_rank, num_dispatch_programs, local_first, NUM_LOCAL, WORLD, DIM, TOP_K, BT, BD, KP, 2,
                       USE_TIMER, RACE, SCOPE)

    if do_tiles != 0:
        col_blocks = tl.cdiv(HIDDEN, BN)
        total = NUM_LOCAL * max_over_ranks(route.num_tiles, NUM_LOCAL) * col_blocks
        task = claim_task(control_ptr, _CTL_DH_TASKS)
        while task < total:
            ready, local, rank, tile, col_block, expert, m0, m1 = gemm_tile_task(
                task, route, arena, anchor_rank, rank_base, control_ptr, col_blocks, local_first, timeout,
                NUM_LOCAL, GROUP_M, True, USE_TIMER, WORLD, BM, RACE, SLACK, SCOPE)
            if ready:
                weights = local.to(tl.int64) * weight_rank_stride + expert.to(tl.int64) * HIDDEN * DIM
                x_rows, dy_rows = token_rows_of(arena, anchor_rank, rank, local, x_ptr, g_ptr, x_rank_stride, WORLD,
                                                DIM)
                grad_hidden_tile(
                    dy_rows,
                    arena_ptr(arena.i32, arena, anchor_rank, rank, arena.slot_copy),
                    w2_ptr + weights, g32_ptr + local.to(tl.int64) * g32_rank_stride,
                    m0, m1, col_block, DIM, HIDDEN, TOP_K, ROW, BM, BN, BK, PRECISION,
                )
                if COPY_ROWS:
                    # The weight gradients' dense slot rows (what gather_slot_rows_kernel
                    # writes otherwise): column chunk ``col_block`` of the tile's rows, so
                    # the copy overlaps the other programs' GEMM work.
                    NHB: tl.constexpr = (HIDDEN + BN - 1) // BN
                    CHUNK: tl.constexpr = ((DIM + NHB - 1) // NHB + BDC - 1) // BDC * BDC
                    capacity = local.to(tl.int64) * 0 + arena.slot_capacity  # int64: S * D may pass 2**31
                    xs = slot_rows_ptr + local.to(tl.int64) * slot_rows_rank_stride
                    offs_s = m0 + tl.arange(0, BM)
                    d_lo = col_block * CHUNK
                    copy_slot_rows(
                        x_rows, dy_rows,
                        arena_ptr(arena.i32, arena, anchor_rank, rank, arena.slot_copy),
                        arena_ptr(arena.f32, arena, anchor_rank, rank, arena.slot_score),
                        xs, xs + capacity * DIM, offs_s, offs_s < m1, d_lo, tl.minimum(d_lo + CHUNK, DIM),
                        DIM, TOP_K, ROW, SCORE_BEFORE, BDC,
                    )
            task = claim_task(control_ptr, _CTL_DH_TASKS)


@triton.jit(do_not_specialize=["anchor_rank", "rank_base"])
def swiglu_backward_kernel(
    g32_ptr,  # (L, S, H) fp32: G = dOut @ w2 per slot (the dH tiles')
    h13_ptr,  # (L, S, 2H) h1 | h3 saved by the forward
    h13_rank_stride,
    h_ptr,  # (L, S, H) out
    dh1_ptr,  # (L, S, H) out
    dh3_ptr,  # (L, S, H) out
    h_rank_stride,
    ds_parts_ptr,  # (L, S, NHB) fp32 out (scores after the experts)
    ds_parts_rank_stride,
    tables_ptr,  # (L, ROUTE_TABLE_ROWS, E) int32
    arena,  # scoreboard.Arena
    anchor_rank,
    rank_base,
    HIDDEN: tl.constexpr,
    NUM_EXPERTS_LOCAL: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    SCORE_BEFORE: tl.constexpr,
    BS: tl.constexpr,
    BN: tl.constexpr,
):
    """The SwiGLU backward (``_swiglu_grad``) as a streaming pass over the dH
    tiles' G and the saved h1 | h3: slots ``[pid0 * BS, + BS)`` below the
    rank's used rows x column block ``pid1`` of ``BN`` (the dH tile width: the
    same score-partial blocks) of local rank ``pid2``."""
    local = tl.program_id(2)
    rank = rank_base + local
    used = used_slots(tables_ptr, local, rank, NUM_EXPERTS_LOCAL, NUM_EXPERTS)
    s0 = tl.program_id(0) * BS
    if s0 < used:
        NHB: tl.constexpr = (HIDDEN + BN - 1) // BN
        col_block = tl.program_id(1)
        offs_m = s0 + tl.arange(0, BS)
        mask_m = offs_m < used
        offs_n = col_block * BN + tl.arange(0, BN)
        mask_n = offs_n < HIDDEN
        mask = mask_m[:, None] & mask_n[None, :]
        hidden_at = local.to(tl.int64) * h_rank_stride
        at = offs_m[:, None].to(tl.int64) * HIDDEN + offs_n[None, :]
        acc_dh = tl.load(g32_ptr + hidden_at + at, mask=mask, other=0.0)
        saved = (h13_ptr + local.to(tl.int64) * h13_rank_stride + offs_m[:, None].to(tl.int64) * (2 * HIDDEN)
                 + offs_n[None, :])
        gate_lp = tl.load(saved, mask=mask, other=0.0)
        up_lp = tl.load(saved + HIDDEN, mask=mask, other=0.0)
        score = tl.load(arena_ptr(arena.f32, arena, anchor_rank, rank, arena.slot_score) + offs_m, mask=mask_m,
                        other=0.0, cache_modifier=".cg")
        _swiglu_grad(acc_dh, gate_lp, up_lp, score, offs_m, mask_m, offs_n, mask_n, h_ptr + hidden_at,
                     dh1_ptr + hidden_at, dh3_ptr + hidden_at,
                     ds_parts_ptr + local.to(tl.int64) * ds_parts_rank_stride, col_block, HIDDEN, NHB, SCORE_BEFORE)
