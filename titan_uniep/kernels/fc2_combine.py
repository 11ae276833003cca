"""fc2_combine (forward megakernel B): grouped GEMM fc2 + combine.

Reads what dispatch_fc1 left (same index arrays, see ``dispatch_fc1``):
``h`` ``(L, S, H)`` in expert-major slots and ``slot_copy`` in this rank's
arena. Writes, in every source rank's arena, ``returned`` ``(T_cap * K, D)``
(expert output of copy ``(t, k)`` at row ``t * K + k``) and bumps
``token_arrivals`` ``(T_cap,) int32`` (one per finished row x column block).

Tasks, claimed from atomic counters by a persistent grid (``fc2_flat_loop``:
the fc2 tasks dealt to the programs in turn instead, in one loop Triton
flattens and software-pipelines across tiles):

1. fc2 task (tile of one local expert x ``fc2_block_n`` columns of y):
   ``y = h @ w2^T`` rounded to the activation dtype (as TorchTitan's grouped
   GEMM output); each row is stored straight into its source rank's
   ``returned[t * K + k]``, then one release arrival per row on the source's
   ``token_arrivals[t]``. ``defer_release``: a tile's arrivals are released
   after the program computed its next tile, by which time the stores have
   landed and the release (a memory barrier of its scope) does not stall.
2. Reduce task (``reduce_block_tokens`` tokens of this rank): wait (acquire,
   bounded) until each token has all ``K * cdiv(D, fc2_block_n)`` arrivals,
   then ``out[t] = sum_k w_k * y[t, k]`` in fp32 in the fixed order
   k = 0..K-1, with ``w_k`` the router score (scores after the experts) or 1
   (scores before), stored in the activation dtype.

Sequential schedule: the same kernel launched once per task kind (fc2 tasks,
then reduce tasks); bitwise identical results.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .scoreboard import (
    CONTROL_WORDS,
    CTL_COMBINE_TILE_TASKS,
    CTL_REDUCE_TASKS,
    SALT_COMBINE,
    arena_ptr,
    claim_task,
    cta_barrier,
    gemm_tile_task,
    has_failed,
    matrix_descriptor,
    max_over_ranks,
    race_rows_delivered,
    race_stamp_rows,
    release_or_defer,
    release_token_arrivals,
    wait_token_rows,
)

_CTL_FC2_TASKS = tl.constexpr(CTL_COMBINE_TILE_TASKS)
_CTL_REDUCE_TASKS = tl.constexpr(CTL_REDUCE_TASKS)
_CONTROL_WORDS = tl.constexpr(CONTROL_WORDS)
_SALT_COMBINE = tl.constexpr(SALT_COMBINE)


@triton.jit
def fc2_tile(
    h, w2, m0, m1, n0, DIM: tl.constexpr, HIDDEN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """y[m0:m1, n0:n0+BN] = h[m0:m1] @ w2^T for one expert (``w2``: its (D, H))."""
    offs_m = m0 + tl.arange(0, BM)
    mask_m = offs_m < m1
    offs_n = n0 + tl.arange(0, BN)
    mask_n = offs_n < DIM
    offs_k = tl.arange(0, BK)
    a_ptrs = h + offs_m[:, None].to(tl.int64) * HIDDEN + offs_k[None, :]
    b_ptrs = w2 + offs_n[None, :].to(tl.int64) * HIDDEN + offs_k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(HIDDEN, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            if EVEN_N:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < HIDDEN - k * BK
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BK
        b_ptrs += BK
    return acc.to(h.dtype.element_ty), offs_m, mask_m, offs_n, mask_n


@triton.jit
def fc2_tile_tma(h_desc, w2_desc, a_row, b_row, HIDDEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, PRECISION: tl.constexpr):
    """``fc2_tile``'s fp32 product, its operands read through tensor
    descriptors: rows ``a_row..+BM`` of h and ``b_row..+BN`` of w2 (both
    ``(rows, H)``; columns past H are zero-filled). Rows past the expert's
    last slot are other experts' or zeros; their output rows are masked."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(HIDDEN, BK)):
        a = h_desc.load([a_row, k * BK])
        b = w2_desc.load([b_row, k * BK])
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    return acc


@triton.jit
def store_rows_to_sources(
    y, offs_m, mask_m, offs_n, mask_n, slot_copy, arena, anchor_rank, DIM: tl.constexpr, TOP_K: tl.constexpr,
):
    """Store each finished row at its source's ``returned[t * K + k]``;
    returns (source rank, token) of each row for ``release_token_arrivals``."""
    copy_id = tl.load(slot_copy + offs_m, mask=mask_m, other=0, cache_modifier=".cg")
    per_rank = arena.token_capacity * TOP_K
    source = copy_id // per_rank
    row = (copy_id % per_rank).to(tl.int64)
    returned = arena_ptr(arena.act, arena, anchor_rank, source, arena.returned)
    tl.store(returned[:, None] + row[:, None] * DIM + offs_n[None, :], y, mask=mask_m[:, None] & mask_n[None, :])
    return source, row // TOP_K


@triton.jit
def reduce_task(
    task, tasks_per_rank, rank_base, control_ptr, route, scores_ptr, out_ptr, out_rank_stride, arena, anchor_rank,
    arrivals_per_token, timeout, DIM: tl.constexpr, TOP_K: tl.constexpr, SCORE_BEFORE: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, USE_TIMER: tl.constexpr, WORLD: tl.constexpr, RACE: tl.constexpr,
    SLACK: tl.constexpr, COL_BLOCKS: tl.constexpr, SCOPE: tl.constexpr,
):
    """out of ``BT`` tokens of one rank, once all their expert rows are back."""
    local = task // tasks_per_rank
    rank = rank_base + local
    control = control_ptr + local * _CONTROL_WORDS
    num_tokens = tl.load(route.num_tokens + local)
    if has_failed(control) == 0:
        offs_t = (task % tasks_per_rank) * BT + tl.arange(0, BT)
        mask_t = offs_t < num_tokens
        if wait_token_rows(arena, anchor_rank, rank, control, task, offs_t, mask_t, arrivals_per_token, timeout,
                           USE_TIMER, WORLD, SCOPE, False, RACE, SLACK, TOP_K, COL_BLOCKS):
            out = out_ptr + local.to(tl.int64) * out_rank_stride
            returned = arena_ptr(arena.act, arena, anchor_rank, rank, arena.returned)
            rows = offs_t.to(tl.int64) * TOP_K
            for d0 in range(0, DIM, BD):
                offs_d = d0 + tl.arange(0, BD)
                mask = mask_t[:, None] & (offs_d < DIM)[None, :]
                acc = tl.zeros((BT, BD), dtype=tl.float32)
                for k in range(0, TOP_K):
                    y = tl.load(
                        returned + (rows + k)[:, None] * DIM + offs_d[None, :], mask=mask, other=0.0,
                        cache_modifier=".cg",
                    )
                    if SCORE_BEFORE:
                        acc += y.to(tl.float32)
                    else:
                        score = tl.load(scores_ptr + local * route.copy_stride + offs_t * TOP_K + k, mask=mask_t)
                        acc += score[:, None] * y.to(tl.float32)
                tl.store(out + offs_t[:, None].to(tl.int64) * DIM + offs_d[None, :], acc.to(out.dtype.element_ty),
                         mask=mask)


@triton.jit
def fc2_task(
    h_ptr, h_rank_stride, w2_ptr, weight_rank_stride, h_desc, w2_desc, control_ptr, arena, anchor_rank,
    local, rank, col_block, expert, m0, m1, pending_source, pending_token, pending,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, COL_BLOCKS: tl.constexpr,
    PRECISION: tl.constexpr, DEFER_RELEASE: tl.constexpr, TMA: tl.constexpr, FLAT: tl.constexpr,
    INTERPRET: tl.constexpr, RACE: tl.constexpr, SCOPE: tl.constexpr,
):
    """One fc2 task: the tile's product, its rows stored at their sources,
    their arrivals released (or kept pending, ``DEFER_RELEASE``: the previous
    tile's go out first). Rows past ``m1`` are masked (a task that is not
    ready comes with ``m0 = m1``). Returns the pending (source, token, mask)."""
    if TMA:
        a_row = local * (h_rank_stride // HIDDEN).to(tl.int32) + m0
        b_row = local * (weight_rank_stride // HIDDEN).to(tl.int32) + expert * DIM + col_block * BN
        y = fc2_tile_tma(h_desc, w2_desc, a_row, b_row, HIDDEN, BM, BN, BK, PRECISION).to(h_ptr.dtype.element_ty)
        offs_m = m0 + tl.arange(0, BM)
        mask_m = offs_m < m1
        offs_n = col_block * BN + tl.arange(0, BN)
        mask_n = offs_n < DIM
    else:
        expert_offset = local.to(tl.int64) * weight_rank_stride + expert.to(tl.int64) * DIM * HIDDEN
        y, offs_m, mask_m, offs_n, mask_n = fc2_tile(
            h_ptr + local.to(tl.int64) * h_rank_stride, w2_ptr + expert_offset,
            m0, m1, col_block * BN, DIM, HIDDEN, BM, BN, BK, EVEN_K, EVEN_N, PRECISION,
        )
    if DEFER_RELEASE:
        release_token_arrivals(pending_source, pending_token, pending, arena, anchor_rank, SCOPE)
    if RACE:
        control = control_ptr + local * _CONTROL_WORDS
        mask_m = race_rows_delivered(arena, anchor_rank, rank, control, offs_m, mask_m, col_block, _SALT_COMBINE)
    slot_copy = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.slot_copy)
    source, token = store_rows_to_sources(y, offs_m, mask_m, offs_n, mask_n, slot_copy, arena, anchor_rank, DIM,
                                          TOP_K)
    if RACE:
        copy_id = tl.load(slot_copy + offs_m, mask=mask_m, other=0, cache_modifier=".cg")
        row = (copy_id % (arena.token_capacity * TOP_K)).to(tl.int64)
        race_stamp_rows(arena, anchor_rank, control, source, row, col_block, mask_m, COL_BLOCKS)
    # Every thread's row stores before any arrival is released.
    if FLAT and not INTERPRET:
        mask_m = mask_m & cta_barrier(m0)
    else:
        tl.debug_barrier()
    return release_or_defer(source, token, mask_m, pending_source, pending_token, pending, arena, anchor_rank,
                            DEFER_RELEASE, SCOPE)


@triton.jit
def fc2_dealt_task(
    task, h_ptr, h_rank_stride, w2_ptr, weight_rank_stride, h_desc, w2_desc, route, control_ptr, arena, anchor_rank,
    rank_base, col_blocks, timeout, pending_source, pending_token, pending,
    NUM_LOCAL: tl.constexpr, WORLD: tl.constexpr, DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, COL_BLOCKS: tl.constexpr, PRECISION: tl.constexpr, USE_TIMER: tl.constexpr,
    DEFER_RELEASE: tl.constexpr, TMA: tl.constexpr, INTERPRET: tl.constexpr, RACE: tl.constexpr,
    SLACK: tl.constexpr, SCOPE: tl.constexpr,
):
    """``fc2_task`` of a task dealt to the program (``fc2_flat_loop``): one
    that is not ready runs with every row masked, with no branch around it."""
    ready, local, rank, tile, col_block, expert, m0, m1 = gemm_tile_task(
        task, route, arena, anchor_rank, rank_base, control_ptr, col_blocks, 0, timeout,
        NUM_LOCAL, GROUP_M, False, USE_TIMER, WORLD, BM, RACE, SLACK, SCOPE)
    return fc2_task(h_ptr, h_rank_stride, w2_ptr, weight_rank_stride, h_desc, w2_desc, control_ptr, arena, anchor_rank,
                    local, rank, col_block, tl.where(ready, expert, 0), tl.where(ready, m0, 0), tl.where(ready, m1, 0),
                    pending_source, pending_token, pending, DIM, HIDDEN, TOP_K, BM, BN, BK, EVEN_K, EVEN_N,
                    COL_BLOCKS, PRECISION, DEFER_RELEASE, TMA, True, INTERPRET, RACE, SCOPE)


@triton.jit(do_not_specialize=["anchor_rank", "rank_base", "do_fc2", "do_reduce", "timeout", "h_rows", "w2_rows"])
def fc2_combine_kernel(
    h_ptr,  # (L, S, H)
    h_rank_stride,
    w2_ptr,  # (L, El, D, H)
    weight_rank_stride,
    scores_ptr,  # (L, T_cap, K) fp32
    route,  # scoreboard.Route
    out_ptr,  # (L, T, D) out
    out_rank_stride,
    control_ptr,  # (L, CONTROL_WORDS) int64
    arena,  # scoreboard.Arena
    anchor_rank,
    rank_base,
    do_fc2,
    do_reduce,
    timeout,
    h_rows,  # rows of h and of w2 as (rows, H) matrices (TMA)
    w2_rows,
    NUM_LOCAL: tl.constexpr, WORLD: tl.constexpr, DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
    SCORE_BEFORE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr, USE_TIMER: tl.constexpr,
    DEFER_RELEASE: tl.constexpr = False,
    TMA: tl.constexpr = False,
    FLAT: tl.constexpr = False,  # LayerParams.fc2_flat_loop
    INTERPRET: tl.constexpr = False,  # TRITON_INTERPRET=1 (programs run one after another)
    RACE: tl.constexpr = False,  # LayerParams.debug_race (testing only; scoreboard: race mode)
    SLACK: tl.constexpr = 0,  # LayerParams.debug_wait_slack (testing only)
    SCOPE: tl.constexpr = "sys",  # scoreboard.sync_scope
):
    EVEN_K: tl.constexpr = HIDDEN % BK == 0
    EVEN_N: tl.constexpr = DIM % BN == 0
    COL_BLOCKS: tl.constexpr = (DIM + BN - 1) // BN
    col_blocks = tl.cdiv(DIM, BN)
    # TMA: fc2 reads h and w2 through tensor descriptors made once per program
    # (the same values as the pointer loads, so the same bits).
    h_desc = matrix_descriptor(h_ptr, h_rows, HIDDEN, BM, BK, TMA)
    w2_desc = matrix_descriptor(w2_ptr, w2_rows, HIDDEN, BN, BK, TMA)
    # DEFER_RELEASE: a tile's arrivals are released after the program's next
    # tile has been computed, so the release (which waits until the tile's
    # stores, remote ones included, have landed) finds them done instead of
    # stalling the SM; the last tile's go out after the loop.
    pending_source = tl.zeros([BM], dtype=tl.int32)
    pending_token = tl.zeros([BM], dtype=tl.int64)
    pending = tl.zeros([BM], dtype=tl.int1)
    if do_fc2 != 0:
        total = NUM_LOCAL * max_over_ranks(route.num_tiles, NUM_LOCAL) * col_blocks
        if FLAT:
            # fc2 tasks wait for nothing, so they need no claims: program p
            # takes tasks p, p + P, ... in one loop around the K-loop, which
            # Triton flattens and software-pipelines across tiles (the next
            # tile's first operand loads are in flight during this tile's
            # epilogue). A task that is not ready runs with every row masked
            # (the K-loop must be the loop body's, not under an ``if``). The
            # interpreter (which takes no tensor loop bounds) runs programs
            # one after another: there program 0 takes every task, in a while
            # loop, before the reduce tasks that wait for all of them.
            if INTERPRET:
                task = tl.where(tl.program_id(0) == 0, 0, total)
                while task < total:
                    pending_source, pending_token, pending = fc2_dealt_task(
                        task, h_ptr, h_rank_stride, w2_ptr, weight_rank_stride, h_desc, w2_desc, route, control_ptr,
                        arena, anchor_rank, rank_base, col_blocks, timeout, pending_source, pending_token, pending,
                        NUM_LOCAL, WORLD, DIM, HIDDEN, TOP_K, BM, BN, BK, GROUP_M, EVEN_K, EVEN_N, COL_BLOCKS,
                        PRECISION, USE_TIMER, DEFER_RELEASE, TMA, INTERPRET, RACE, SLACK, SCOPE)
                    task += 1
            else:
                for task in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=True):
                    pending_source, pending_token, pending = fc2_dealt_task(
                        task, h_ptr, h_rank_stride, w2_ptr, weight_rank_stride, h_desc, w2_desc, route, control_ptr,
                        arena, anchor_rank, rank_base, col_blocks, timeout, pending_source, pending_token, pending,
                        NUM_LOCAL, WORLD, DIM, HIDDEN, TOP_K, BM, BN, BK, GROUP_M, EVEN_K, EVEN_N, COL_BLOCKS,
                        PRECISION, USE_TIMER, DEFER_RELEASE, TMA, INTERPRET, RACE, SLACK, SCOPE)
        else:
            task = claim_task(control_ptr, _CTL_FC2_TASKS)
            while task < total:
                ready, local, rank, tile, col_block, expert, m0, m1 = gemm_tile_task(
                    task, route, arena, anchor_rank, rank_base, control_ptr, col_blocks, 0, timeout,
                    NUM_LOCAL, GROUP_M, False, USE_TIMER, WORLD, BM, RACE, SLACK, SCOPE)
                if ready:
                    pending_source, pending_token, pending = fc2_task(
                        h_ptr, h_rank_stride, w2_ptr, weight_rank_stride, h_desc, w2_desc, control_ptr, arena,
                        anchor_rank, local, rank, col_block, expert, m0, m1, pending_source, pending_token,
                        pending, DIM, HIDDEN, TOP_K, BM, BN, BK, EVEN_K, EVEN_N, COL_BLOCKS, PRECISION,
                        DEFER_RELEASE, TMA, False, INTERPRET, RACE, SCOPE)
                task = claim_task(control_ptr, _CTL_FC2_TASKS)
        if DEFER_RELEASE:
            release_token_arrivals(pending_source, pending_token, pending, arena, anchor_rank, SCOPE)

    if do_reduce != 0:
        tasks_per_rank = tl.cdiv(max_over_ranks(route.num_tokens, NUM_LOCAL), BT)
        total = NUM_LOCAL * tasks_per_rank
        arrivals_per_token = TOP_K * col_blocks
        task = claim_task(control_ptr, _CTL_REDUCE_TASKS)
        while task < total:
            reduce_task(task, tasks_per_rank, rank_base, control_ptr, route, scores_ptr, out_ptr, out_rank_stride,
                        arena, anchor_rank, arrivals_per_token, timeout, DIM, TOP_K, SCORE_BEFORE, BT, BD,
                        USE_TIMER, WORLD, RACE, SLACK, COL_BLOCKS, SCOPE)
            task = claim_task(control_ptr, _CTL_REDUCE_TASKS)
