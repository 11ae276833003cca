"""da_combine (backward megakernel BB): the dA tiles + combine of dx and the
router-score gradients.

Reads what ``dispatch_dh`` (and the SwiGLU backward pass) left: ``dh1``,
``dh3`` ``(L, S, H)`` and ``ds_parts`` ``(L, S, NHB)`` fp32 per slot, and in
every rank's arena (``scoreboard.Arena``) ``returned`` ``(T_cap * K, R)``
(``R``: ``runtime.workspace.backward_returned_row``, ``D * b + 4`` bytes
rounded up to 128): columns ``[0, D)`` the dA row of copy ``(t, k)``, the next
fp32 word its router-score gradient (scores after the experts);
``token_arrivals`` ``(T_cap,)``.

Tasks:

1. dA tile (expert rows x ``da_block_n`` columns of D):
   ``dA = dh1 @ w1 + dh3 @ w3`` (one fp32 accumulator), stored into the
   source's ``returned[t * K + k]``; scores after the experts, the tiles of
   column block 0 also sum each row's ``NHB`` score partials in column-block
   order (``ordered_sums``) and store the sum next to it; then one release
   arrival per row on the source's ``token_arrivals[t]``.
2. reduce (``reduce_block_tokens`` tokens): wait for ``K * cdiv(D, BN)``
   arrivals per token, then in fp32 and fixed order ``k = 0..K-1``:
   ``dx = sum_k dA`` (after) or ``sum_k s * dA`` (before), and ``ds`` = the
   returned sum (after) or ``<x, dA>`` (before: per ``BD`` block of columns a
   pairwise sum, ``ordered_sums``, the blocks in column order).

The router-score sums are the only sums over a tile's columns here; their
order is fixed by the column indices, so ``block_m``, ``reduce_block_tokens``
and the warps (which shape the tiles' layouts on a GPU) keep the bits.

Sequential schedule: the kernel once with dA tiles only, once with reduce
tasks only; fused: both in one persistent grid. Bitwise equal.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .ordered_sums import ordered_partials_sum, pairwise_row_sum
from .scoreboard import (
    CONTROL_WORDS,
    CTL_COMBINE_TILE_TASKS,
    CTL_REDUCE_TASKS,
    SALT_COMBINE,
    arena_ptr,
    claim_task,
    gemm_tile_task,
    has_failed,
    matrix_descriptor,
    max_over_ranks,
    race_rows_delivered,
    race_stamp_rows,
    release_token_arrivals,
    wait_token_rows,
)

_CTL_DA_TASKS = tl.constexpr(CTL_COMBINE_TILE_TASKS)
_CTL_REDUCE_TASKS = tl.constexpr(CTL_REDUCE_TASKS)
_CONTROL_WORDS = tl.constexpr(CONTROL_WORDS)
_SALT_COMBINE = tl.constexpr(SALT_COMBINE)


@triton.jit
def da_tile(
    dh1, dh3, w1, w3, ds_parts, slot_copy, m0, m1, n0,
    arena, anchor_rank, d1_desc, d3_desc, w1_desc, w3_desc, a_row, b_row, control, rank,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, SCORE_BEFORE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NHB: tl.constexpr, NHBP: tl.constexpr,
    RET_ROW: tl.constexpr, RET_ROW_F32: tl.constexpr, PARTS_AT_F32: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr, RACE: tl.constexpr, COL_BLOCKS: tl.constexpr, SCOPE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dA of slots ``m0..m1``, columns ``n0..n0+BN`` of D (one K-loop over H:
    ``dA = dh1 @ w1 + dh3 @ w3``), stored at each row's source; scores after
    the experts, the column-block-0 tile also sends each row's router-score
    gradient (its ``NHB`` partials summed in fp32). Returns (source rank,
    token, mask) of the rows, whose arrivals the caller releases.
    ``TMA``: the operands come through the tensor descriptors (``H`` a
    multiple of ``BK``). ``RACE``: only a seeded subset of the rows is sent
    (``control``, ``rank``: this rank's), each stamped at its source."""
    EVEN_K: tl.constexpr = HIDDEN % BK == 0
    EVEN_N: tl.constexpr = DIM % BN == 0
    offs_m = m0 + tl.arange(0, BM)
    mask_m = offs_m < m1
    offs_n = n0 + tl.arange(0, BN)
    mask_n = offs_n < DIM
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if TMA:
        # The same operand values through tensor descriptors (the same bits):
        # rows a_row.. of dh1 | dh3, rows b_row.. (H of this expert) of w1 | w3.
        for k in range(0, tl.cdiv(HIDDEN, BK)):
            acc = tl.dot(d1_desc.load([a_row, k * BK]), w1_desc.load([b_row + k * BK, n0]), acc,
                         input_precision=PRECISION)
            acc = tl.dot(d3_desc.load([a_row, k * BK]), w3_desc.load([b_row + k * BK, n0]), acc,
                         input_precision=PRECISION)
    else:
        offs_k = tl.arange(0, BK)
        g_ptrs = offs_m[:, None].to(tl.int64) * HIDDEN + offs_k[None, :]
        b_ptrs = offs_k[:, None].to(tl.int64) * DIM + offs_n[None, :]
        for k in range(0, tl.cdiv(HIDDEN, BK)):
            if EVEN_K:
                g1 = tl.load(dh1 + g_ptrs, mask=mask_m[:, None], other=0.0)
                g3 = tl.load(dh3 + g_ptrs, mask=mask_m[:, None], other=0.0)
                if EVEN_N:
                    b1 = tl.load(w1 + b_ptrs)
                    b3 = tl.load(w3 + b_ptrs)
                else:
                    b1 = tl.load(w1 + b_ptrs, mask=mask_n[None, :], other=0.0)
                    b3 = tl.load(w3 + b_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                mask_k = offs_k < HIDDEN - k * BK
                g1 = tl.load(dh1 + g_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                g3 = tl.load(dh3 + g_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                b1 = tl.load(w1 + b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                b3 = tl.load(w3 + b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(g1, b1, acc, input_precision=PRECISION)
            acc = tl.dot(g3, b3, acc, input_precision=PRECISION)
            g_ptrs += BK
            b_ptrs += BK * DIM
    if RACE:
        mask_m = race_rows_delivered(arena, anchor_rank, rank, control, offs_m, mask_m, n0 // BN, _SALT_COMBINE)
    copy_id = tl.load(slot_copy + offs_m, mask=mask_m, other=0, cache_modifier=".cg")
    per_rank = arena.token_capacity * TOP_K
    source = copy_id // per_rank
    row = (copy_id % per_rank).to(tl.int64)
    mask = mask_m[:, None] & mask_n[None, :]
    returned = arena_ptr(arena.act, arena, anchor_rank, source, arena.returned)
    tl.store(returned[:, None] + row[:, None] * RET_ROW + offs_n[None, :], acc.to(dh1.dtype.element_ty),
             mask=mask)
    if not SCORE_BEFORE:
        if n0 == 0:
            row_parts = ds_parts + offs_m.to(tl.int64) * NHB
            if INTERPRET:
                offs_p = tl.arange(0, NHBP)
                parts = tl.load(row_parts[:, None] + offs_p[None, :], mask=mask_m[:, None] & (offs_p < NHB)[None, :],
                                other=0.0)
                total = tl.sum(parts, axis=1)
            else:
                total = ordered_partials_sum(row_parts, mask_m, NHB)
            ds = arena_ptr(arena.f32, arena, anchor_rank, source, arena.returned_f32)
            tl.store(ds + row * RET_ROW_F32 + PARTS_AT_F32, total, mask=mask_m)
    if RACE:
        race_stamp_rows(arena, anchor_rank, control, source, row, n0 // BN, mask_m, COL_BLOCKS)
    # Every thread's row stores before any arrival is released (by the caller).
    tl.debug_barrier()
    return source, row // TOP_K, mask_m


@triton.jit
def da_reduce_task(
    task, tasks_per_rank, rank_base, control_ptr, route, scores_ptr, x_ptr, x_rank_stride, dx_ptr, ds_ptr, arena,
    anchor_rank, arrivals_per_token, timeout,
    DIM: tl.constexpr, TOP_K: tl.constexpr, SCORE_BEFORE: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr,
    KP: tl.constexpr, RET_ROW: tl.constexpr, RET_ROW_F32: tl.constexpr, PARTS_AT_F32: tl.constexpr,
    USE_TIMER: tl.constexpr,
    WORLD: tl.constexpr, RACE: tl.constexpr, SLACK: tl.constexpr, COL_BLOCKS: tl.constexpr,
    SCOPE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dx and ds of ``BT`` tokens, once all their dA rows are back."""
    local = task // tasks_per_rank
    rank = rank_base + local
    control = control_ptr + local * _CONTROL_WORDS
    num_tokens = tl.load(route.num_tokens + local)
    if has_failed(control) == 0:
        offs_t = (task % tasks_per_rank) * BT + tl.arange(0, BT)
        mask_t = offs_t < num_tokens
        if wait_token_rows(arena, anchor_rank, rank, control, task, offs_t, mask_t, arrivals_per_token, timeout,
                           USE_TIMER, WORLD, SCOPE, False, RACE, SLACK, TOP_K, COL_BLOCKS):
            returned = arena_ptr(arena.act, arena, anchor_rank, rank, arena.returned)
            rows = offs_t.to(tl.int64) * TOP_K
            offs_k = tl.arange(0, KP)
            mask_tk = mask_t[:, None] & (offs_k < TOP_K)[None, :]
            copies = local * route.copy_stride + offs_t[:, None] * TOP_K + offs_k[None, :]
            ds = tl.zeros((BT, KP), dtype=tl.float32)
            tok = local.to(tl.int64) * x_rank_stride + offs_t[:, None].to(tl.int64) * DIM
            for d0 in range(0, DIM, BD):
                offs_d = d0 + tl.arange(0, BD)
                mask = mask_t[:, None] & (offs_d < DIM)[None, :]
                acc = tl.zeros((BT, BD), dtype=tl.float32)
                if SCORE_BEFORE:
                    x = tl.load(x_ptr + tok + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
                for k in range(0, TOP_K):
                    da = tl.load(returned + (rows + k)[:, None] * RET_ROW + offs_d[None, :], mask=mask,
                                 other=0.0, cache_modifier=".cg").to(tl.float32)
                    if SCORE_BEFORE:
                        score = tl.load(scores_ptr + local * route.copy_stride + offs_t * TOP_K + k, mask=mask_t)
                        acc += score[:, None] * da
                        if INTERPRET:
                            part = tl.sum(x * da, axis=1)
                        else:
                            part = pairwise_row_sum(x * da, BT)
                        ds += tl.where(offs_k[None, :] == k, part[:, None], 0.0)
                    else:
                        acc += da
                tl.store(dx_ptr + tok + offs_d[None, :], acc.to(dx_ptr.dtype.element_ty), mask=mask)
            if not SCORE_BEFORE:
                returned_f32 = arena_ptr(arena.f32, arena, anchor_rank, rank, arena.returned_f32)
                at = (rows[:, None] + offs_k[None, :]) * RET_ROW_F32 + PARTS_AT_F32
                ds = tl.load(returned_f32 + at, mask=mask_tk, other=0.0, cache_modifier=".cg")
            tl.store(ds_ptr + copies, ds, mask=mask_tk)


@triton.jit(do_not_specialize=["anchor_rank", "rank_base", "do_tiles", "do_reduce", "timeout", "dh_rows", "w_rows"])
def da_combine_kernel(
    dh1_ptr,  # (L, S, H)
    dh3_ptr,  # (L, S, H)
    h_rank_stride,
    w1_ptr,  # (L, El, H, D)
    w3_ptr,  # (L, El, H, D)
    weight_rank_stride,
    ds_parts_ptr,  # (L, S, NHB) fp32 (scores after the experts)
    ds_parts_rank_stride,
    scores_ptr,  # (L, T_cap, K) fp32
    route,  # scoreboard.Route
    x_ptr,  # (L, T, D)
    x_rank_stride,
    dx_ptr,  # (L, T, D) out
    ds_ptr,  # (L, T_cap, K) fp32 out
    control_ptr,  # (L, CONTROL_WORDS) int64
    arena,  # scoreboard.Arena
    anchor_rank,
    rank_base,
    do_tiles,
    do_reduce,
    timeout,
    dh_rows,  # rows of dh1 / dh3 as (rows, H) and of w1 / w3 as (rows, D) matrices (TMA)
    w_rows,
    NUM_LOCAL: tl.constexpr, DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
    KP: tl.constexpr,  # next power of two >= TOP_K
    SCORE_BEFORE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NHB: tl.constexpr,  # column blocks of the dH tiles (score partials per slot)
    NHBP: tl.constexpr,  # next power of two >= NHB
    GROUP_M: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    RET_ROW: tl.constexpr,  # elements per returned row (workspace.backward_returned_row)
    RET_ROW_F32: tl.constexpr,  # fp32 words per returned row
    PARTS_AT_F32: tl.constexpr,  # fp32 word of a returned row that holds its score gradient
    PRECISION: tl.constexpr, USE_TIMER: tl.constexpr,
    WORLD: tl.constexpr,  # EP size (a failure sets every rank's abort word)
    TMA: tl.constexpr = False,
    RACE: tl.constexpr = False,  # LayerParams.debug_race (testing only; scoreboard: race mode)
    SLACK: tl.constexpr = 0,  # LayerParams.debug_wait_slack (testing only)
    SCOPE: tl.constexpr = "sys",  # scoreboard.sync_scope
    INTERPRET: tl.constexpr = False,  # Triton's interpreter: tl.sum for the score sums (ordered_sums)
):
    COL_BLOCKS: tl.constexpr = (DIM + BN - 1) // BN
    col_blocks = tl.cdiv(DIM, BN)
    d1_desc = matrix_descriptor(dh1_ptr, dh_rows, HIDDEN, BM, BK, TMA)
    d3_desc = matrix_descriptor(dh3_ptr, dh_rows, HIDDEN, BM, BK, TMA)
    w1_desc = matrix_descriptor(w1_ptr, w_rows, DIM, BK, BN, TMA)
    w3_desc = matrix_descriptor(w3_ptr, w_rows, DIM, BK, BN, TMA)
    if do_tiles != 0:
        total = NUM_LOCAL * max_over_ranks(route.num_tiles, NUM_LOCAL) * col_blocks
        task = claim_task(control_ptr, _CTL_DA_TASKS)
        while task < total:
            ready, local, rank, tile, col_block, expert, m0, m1 = gemm_tile_task(
                task, route, arena, anchor_rank, rank_base, control_ptr, col_blocks, 0, timeout,
                NUM_LOCAL, GROUP_M, False, USE_TIMER, WORLD, BM, RACE, SLACK, SCOPE)
            if ready:
                weights = local.to(tl.int64) * weight_rank_stride + expert.to(tl.int64) * HIDDEN * DIM
                hidden_at = local.to(tl.int64) * h_rank_stride
                source, token, rows = da_tile(
                    dh1_ptr + hidden_at, dh3_ptr + hidden_at, w1_ptr + weights, w3_ptr + weights,
                    ds_parts_ptr + local.to(tl.int64) * ds_parts_rank_stride,
                    arena_ptr(arena.i32, arena, anchor_rank, rank, arena.slot_copy),
                    m0, m1, col_block * BN, arena, anchor_rank, d1_desc, d3_desc, w1_desc, w3_desc,
                    local * (h_rank_stride // HIDDEN).to(tl.int32) + m0,
                    local * (weight_rank_stride // DIM).to(tl.int32) + expert * HIDDEN,
                    control_ptr + local * _CONTROL_WORDS, rank,
                    DIM, HIDDEN, TOP_K, SCORE_BEFORE, BM, BN, BK, NHB, NHBP,
                    RET_ROW, RET_ROW_F32, PARTS_AT_F32, PRECISION, TMA, RACE, COL_BLOCKS, SCOPE, INTERPRET,
                )
                release_token_arrivals(source, token, rows, arena, anchor_rank, SCOPE)
            task = claim_task(control_ptr, _CTL_DA_TASKS)

    if do_reduce != 0:
        tasks_per_rank = tl.cdiv(max_over_ranks(route.num_tokens, NUM_LOCAL), BT)
        total = NUM_LOCAL * tasks_per_rank
        task = claim_task(control_ptr, _CTL_REDUCE_TASKS)
        while task < total:
            da_reduce_task(task, tasks_per_rank, rank_base, control_ptr, route, scores_ptr, x_ptr, x_rank_stride,
                           dx_ptr, ds_ptr, arena, anchor_rank, TOP_K * col_blocks, timeout, DIM, TOP_K, SCORE_BEFORE,
                           BT, BD, KP, RET_ROW, RET_ROW_F32, PARTS_AT_F32, USE_TIMER, WORLD, RACE, SLACK,
                           COL_BLOCKS, SCOPE, INTERPRET)
            task = claim_task(control_ptr, _CTL_REDUCE_TASKS)
