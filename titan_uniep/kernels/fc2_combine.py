"""fc2_combine (forward megakernel B): grouped GEMM fc2 + combine.

Reads what dispatch_fc1 left (same index arrays, see ``dispatch_fc1``):
``h`` ``(L, S, H)`` in expert-major slots and ``slot_copy`` in this rank's
arena. Writes, in every source rank's arena, ``returned`` ``(T_cap * K, D)``
(expert output of copy ``(t, k)`` at row ``t * K + k``) and bumps
``token_arrivals`` ``(T_cap,) int32`` (one per finished row x column block).

Tasks, claimed from atomic counters by a persistent grid:

1. fc2 task (tile of one local expert x ``fc2_block_n`` columns of y):
   ``y = h @ w2^T`` rounded to the activation dtype (as TorchTitan's grouped
   GEMM output). Combine ``"direct"``: each row is stored straight into its
   source rank's ``returned[t * K + k]``, then one release arrival per row on
   the source's ``token_arrivals[t]``. Combine ``"staged"``: the tile goes to
   this rank's ``y`` ``(L, S, D)`` and ``tile_done[tile]`` is bumped; the GEMM
   program never waits for NVLink (a release at system scope after remote
   stores stalls the SM until they land). ``defer_release`` (direct only):
   a tile's arrivals are released after the program computed its next tile,
   by which time the stores have landed and the release does not stall.
1b. Send task (staged only; one tile): wait until all its column blocks are
   done, copy its rows to their sources' ``returned``, release one arrival
   per row. Run by the last ``num_combine_sms`` programs from the start and
   by every other program once the fc2 tasks are gone.
2. Reduce task (``reduce_block_tokens`` tokens of this rank): wait (acquire,
   bounded) until each token has all ``K * cdiv(D, fc2_block_n)`` arrivals,
   then ``out[t] = sum_k w_k * y[t, k]`` in fp32 in the fixed order
   k = 0..K-1, with ``w_k`` the router score (scores after the experts) or 1
   (scores before), stored in the activation dtype.

Combine ``"presum"`` (``PRESUM``): the fc2 tile goes to this rank's ``y`` and
bumps ``tile_done`` as in the staged combine. 1c. Presum task (``BT`` slots of
one tile, on the expert rank): a slot whose copy ``(s, t, k)`` is the first of
token ``t``'s copies on this rank (``token_slots``, written by the dispatch)
waits for the fc2 tiles of all the token's copies here, sums their rows in
fp32 in the fixed order k = 0..K-1 with the router scores (or 1), stores the
fp32 partial at the source's ``partials[t * W + r]`` and releases one arrival
on its ``token_arrivals[t]``. 2'. The reduce then waits, per token, for one
arrival per rank the token went to and sums the partials in rank order
0..W-1 in fp32. One row per (token, rank) crosses NVLink instead of one per
copy; the rounding differs from ``direct``/``staged`` (partials per rank).

Sequential schedule: the same kernel launched once per task kind (fc2 tasks,
then send / presum tasks, then reduce tasks); bitwise identical results.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .scoreboard import (
    CONTROL_WORDS,
    CTL_COMBINE_TILE_TASKS,
    CTL_REDUCE_TASKS,
    CTL_SEND_TASKS,
    SALT_COMBINE,
    WAIT_TILE_DONE,
    arena_ptr,
    claim_task,
    gemm_tile_task,
    abort_word,
    has_failed,
    matrix_descriptor,
    max_over_ranks,
    race_rows_delivered,
    race_stamp_rows,
    release_or_defer,
    release_token_arrivals,
    wait_counter_at_least,
    wait_counters_at_least,
    wait_failed,
    wait_token_rows,
)

_CTL_FC2_TASKS = tl.constexpr(CTL_COMBINE_TILE_TASKS)
_CTL_REDUCE_TASKS = tl.constexpr(CTL_REDUCE_TASKS)
_CTL_SEND_TASKS = tl.constexpr(CTL_SEND_TASKS)
_WAIT_TILE_DONE = tl.constexpr(WAIT_TILE_DONE)
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
def send_task(
    task, rank_base, control_ptr, route, y_ptr, y_rank_stride, arena, anchor_rank, col_blocks, timeout,
    NUM_LOCAL: tl.constexpr, DIM: tl.constexpr, TOP_K: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
    USE_TIMER: tl.constexpr, WORLD: tl.constexpr, RACE: tl.constexpr, COL_BLOCKS: tl.constexpr,
    SCOPE: tl.constexpr,
):
    """Staged combine: send one finished fc2 tile's rows to their sources
    (``RACE``: a seeded subset of them, each stamped in every column block)."""
    local = task % NUM_LOCAL
    tile = task // NUM_LOCAL
    rank = rank_base + local
    control = control_ptr + local * _CONTROL_WORDS
    if (tile < tl.load(route.num_tiles + local)) & (has_failed(control) == 0):
        m0 = tl.load(route.tile_start + local * route.tile_stride + tile)
        m1 = tl.load(route.tile_end + local * route.tile_stride + tile)
        tile_done = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.tile_done) + tile
        seen, stopped = wait_counter_at_least(tile_done, col_blocks, abort_word(arena, anchor_rank, rank), timeout,
                                              USE_TIMER, SCOPE)
        if seen < col_blocks:
            wait_failed(control, arena, anchor_rank, rank, task, _WAIT_TILE_DONE, tile, col_blocks, seen, stopped,
                        timeout, WORLD, USE_TIMER)
        elif m1 <= arena.slot_capacity:
            offs_m = m0 + tl.arange(0, BM)
            mask_m = offs_m < m1
            if RACE:
                mask_m = race_rows_delivered(arena, anchor_rank, rank, control, offs_m, mask_m, 0, _SALT_COMBINE)
            slot_copy = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.slot_copy)
            copy_id = tl.load(slot_copy + offs_m, mask=mask_m, other=0, cache_modifier=".cg")
            per_rank = arena.token_capacity * TOP_K
            source = copy_id // per_rank
            row = (copy_id % per_rank).to(tl.int64)
            returned = arena_ptr(arena.act, arena, anchor_rank, source, arena.returned)
            staged = y_ptr + local.to(tl.int64) * y_rank_stride + offs_m[:, None].to(tl.int64) * DIM
            for d0 in range(0, DIM, BD):
                offs_d = d0 + tl.arange(0, BD)
                mask = mask_m[:, None] & (offs_d < DIM)[None, :]
                rows = tl.load(staged + offs_d[None, :], mask=mask, cache_modifier=".cg")
                tl.store(returned[:, None] + row[:, None] * DIM + offs_d[None, :], rows, mask=mask)
            if RACE:
                for col_block in range(COL_BLOCKS):
                    race_stamp_rows(arena, anchor_rank, control, source, row, col_block, mask_m, COL_BLOCKS)
            tl.debug_barrier()
            release_token_arrivals(source, row // TOP_K, mask_m, arena, anchor_rank, SCOPE)


@triton.jit
def presum_task(
    task, rank_base, control_ptr, route, y_ptr, y_rank_stride, arena, anchor_rank, col_blocks, timeout,
    NUM_LOCAL: tl.constexpr, WORLD: tl.constexpr, DIM: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
    SCORE_BEFORE: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, USE_TIMER: tl.constexpr,
    SCOPE: tl.constexpr,
):
    """Presum combine (not in race mode): sum the same-rank rows of the tokens whose first copy
    here lies in ``BT`` slots of one tile; send one fp32 partial per token."""
    chunks: tl.constexpr = BM // BT
    local = task % NUM_LOCAL
    tile = (task // NUM_LOCAL) // chunks
    chunk = (task // NUM_LOCAL) % chunks
    rank = rank_base + local
    control = control_ptr + local * _CONTROL_WORDS
    if (tile < tl.load(route.num_tiles + local)) & (has_failed(control) == 0):
        m0 = tl.load(route.tile_start + local * route.tile_stride + tile)
        m1 = tl.load(route.tile_end + local * route.tile_stride + tile)
        offs_m = m0 + chunk * BT + tl.arange(0, BT)
        mask_m = (offs_m < m1) & (m1 <= arena.slot_capacity)
        slot_copy = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.slot_copy)
        copy_id = tl.load(slot_copy + offs_m, mask=mask_m, other=0, cache_modifier=".cg")
        k_self = copy_id % TOP_K
        base = (copy_id - k_self).to(tl.int64)
        offs_k = tl.arange(0, KP)
        mask_mk = mask_m[:, None] & (offs_k < TOP_K)[None, :]
        token_slots = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.token_slots)
        token_tiles = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.token_tiles)
        slots = tl.load(token_slots + base[:, None] + offs_k[None, :], mask=mask_mk, other=-1, cache_modifier=".cg")
        tiles = tl.load(token_tiles + base[:, None] + offs_k[None, :], mask=mask_mk, other=-1, cache_modifier=".cg")
        earlier = tl.sum(tl.where((offs_k[None, :] < k_self[:, None]) & (slots >= 0), 1, 0), axis=1)
        lead = mask_m & (earlier == 0)
        # One bounded wait over the fc2 tiles of every lead token's copies here.
        tile_done = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.tile_done)
        wait = lead[:, None] & (tiles >= 0)
        seen, stopped = wait_counters_at_least(tile_done + tl.maximum(tiles, 0), wait, col_blocks,
                                               abort_word(arena, anchor_rank, rank), timeout, USE_TIMER, SCOPE)
        short = wait & (seen < col_blocks)
        if tl.max(tl.max(short.to(tl.int32), axis=1), axis=0) > 0:
            first = tl.min(tl.min(tl.where(short, tiles, 1 << 30), axis=1), axis=0)
            wait_failed(control, arena, anchor_rank, rank, task, _WAIT_TILE_DONE, first, col_blocks,
                        tl.min(tl.min(tl.where(short, seen, 1 << 30), axis=1), axis=0), stopped, timeout, WORLD,
                        USE_TIMER)
        else:
            per_rank = arena.token_capacity * TOP_K
            source = copy_id // per_rank
            token = ((copy_id % per_rank) // TOP_K).to(tl.int64)
            partials = arena_ptr(arena.f32, arena, anchor_rank, source, arena.partials)
            dst = partials[:, None] + (token * WORLD + rank)[:, None] * DIM
            y = y_ptr + local.to(tl.int64) * y_rank_stride
            slot_score = arena_ptr(arena.f32, arena, anchor_rank, rank, arena.slot_score)
            for d0 in range(0, DIM, BD):
                offs_d = d0 + tl.arange(0, BD)
                mask_d = offs_d < DIM
                acc = tl.zeros((BT, BD), dtype=tl.float32)
                for kk in range(0, TOP_K):
                    slot_k = tl.sum(tl.where(offs_k[None, :] == kk, slots, 0), axis=1)
                    use = lead & (slot_k >= 0)
                    rows = tl.load(y + tl.maximum(slot_k, 0).to(tl.int64)[:, None] * DIM + offs_d[None, :],
                                   mask=use[:, None] & mask_d[None, :], other=0.0, cache_modifier=".cg")
                    if SCORE_BEFORE:
                        acc += rows.to(tl.float32)
                    else:
                        score = tl.load(slot_score + tl.maximum(slot_k, 0), mask=use, other=0.0, cache_modifier=".cg")
                        acc += score[:, None] * rows.to(tl.float32)
                tl.store(dst + offs_d[None, :], acc, mask=lead[:, None] & mask_d[None, :])
            # Every thread's partial stores before any arrival is released.
            tl.debug_barrier()
            release_token_arrivals(source, token, lead, arena, anchor_rank, SCOPE)


@triton.jit
def presum_reduce_task(
    task, tasks_per_rank, rank_base, control_ptr, route, out_ptr, out_rank_stride, arena, anchor_rank, timeout,
    WORLD: tl.constexpr, DIM: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr, USE_TIMER: tl.constexpr, SCOPE: tl.constexpr,
):
    """Presum combine, on the source: ``out[t] = sum_r partial[t, r]`` in fp32
    over the ranks ``r = 0..W-1`` that token ``t`` went to."""
    local = task // tasks_per_rank
    rank = rank_base + local
    control = control_ptr + local * _CONTROL_WORDS
    num_tokens = tl.load(route.num_tokens + local)
    if has_failed(control) == 0:
        offs_t = (task % tasks_per_rank) * BT + tl.arange(0, BT)
        mask_t = offs_t < num_tokens
        offs_k = tl.arange(0, KP)
        dest = tl.load(route.dest_rank + local * route.copy_stride + offs_t[:, None] * TOP_K + offs_k[None, :],
                       mask=mask_t[:, None] & (offs_k < TOP_K)[None, :], other=-1)
        expected = tl.zeros([BT], dtype=tl.int32)
        for p in range(WORLD):
            expected += tl.max(tl.where(dest == p, 1, 0), axis=1)
        if wait_token_rows(arena, anchor_rank, rank, control, task, offs_t, mask_t, expected, timeout, USE_TIMER,
                           WORLD, SCOPE, True):
            out = out_ptr + local.to(tl.int64) * out_rank_stride
            partials = arena_ptr(arena.f32, arena, anchor_rank, rank, arena.partials)
            rows = offs_t.to(tl.int64) * WORLD
            for d0 in range(0, DIM, BD):
                offs_d = d0 + tl.arange(0, BD)
                mask = mask_t[:, None] & (offs_d < DIM)[None, :]
                acc = tl.zeros((BT, BD), dtype=tl.float32)
                for p in range(WORLD):
                    there = tl.max(tl.where(dest == p, 1, 0), axis=1) > 0
                    part = tl.load(partials + (rows + p)[:, None] * DIM + offs_d[None, :],
                                   mask=mask & there[:, None], other=0.0, cache_modifier=".cg")
                    acc = tl.where(there[:, None], acc + part, acc)
                tl.store(out + offs_t[:, None].to(tl.int64) * DIM + offs_d[None, :], acc.to(out.dtype.element_ty),
                         mask=mask)


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


@triton.jit(do_not_specialize=["anchor_rank", "rank_base", "do_fc2", "do_send", "do_reduce", "num_send_programs",
                               "timeout", "h_rows", "w2_rows"])
def fc2_combine_kernel(
    h_ptr,  # (L, S, H)
    h_rank_stride,
    w2_ptr,  # (L, El, D, H)
    weight_rank_stride,
    scores_ptr,  # (L, T_cap, K) fp32
    route,  # scoreboard.Route
    out_ptr,  # (L, T, D) out
    out_rank_stride,
    y_ptr,  # (L, S, D) staged expert outputs (staged / presum combine only; any pointer otherwise)
    y_rank_stride,
    control_ptr,  # (L, CONTROL_WORDS) int64
    arena,  # scoreboard.Arena
    anchor_rank,
    rank_base,
    do_fc2,
    do_send,
    do_reduce,
    num_send_programs,
    timeout,
    h_rows,  # rows of h and of w2 as (rows, H) matrices (TMA)
    w2_rows,
    NUM_LOCAL: tl.constexpr, WORLD: tl.constexpr, DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
    KP: tl.constexpr,  # next power of two >= TOP_K
    SCORE_BEFORE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr, USE_TIMER: tl.constexpr,
    STAGED: tl.constexpr = False, PRESUM: tl.constexpr = False, DEFER_RELEASE: tl.constexpr = False,
    TMA: tl.constexpr = False,
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
    # Direct combine with DEFER_RELEASE: a tile's arrivals are released after
    # the program's next tile has been computed, so the system-scope release
    # (which waits until the tile's remote stores have landed) finds them
    # done instead of stalling the SM; the last tile's go out after the loop.
    pending_source = tl.zeros([BM], dtype=tl.int32)
    pending_token = tl.zeros([BM], dtype=tl.int64)
    pending = tl.zeros([BM], dtype=tl.int1)
    # Send-only programs are the last ones: under the interpreter, programs run
    # in order and the GEMM programs (producers) must come first.
    send_only = STAGED & (tl.program_id(0) >= tl.num_programs(0) - num_send_programs)
    if (do_fc2 != 0) & (send_only == 0):
        total = NUM_LOCAL * max_over_ranks(route.num_tiles, NUM_LOCAL) * col_blocks
        task = claim_task(control_ptr, _CTL_FC2_TASKS)
        while task < total:
            ready, local, rank, tile, col_block, expert, m0, m1 = gemm_tile_task(
                task, route, arena, anchor_rank, rank_base, control_ptr, col_blocks, 0, timeout,
                NUM_LOCAL, GROUP_M, False, USE_TIMER, WORLD, BM, RACE, SLACK, SCOPE)
            if ready:
                if TMA:
                    a_row = local * (h_rank_stride // HIDDEN).to(tl.int32) + m0
                    b_row = (local * (weight_rank_stride // HIDDEN).to(tl.int32) + expert * DIM
                             + col_block * BN)
                    y = fc2_tile_tma(h_desc, w2_desc, a_row, b_row, HIDDEN, BM, BN, BK,
                                     PRECISION).to(h_ptr.dtype.element_ty)
                    offs_m = m0 + tl.arange(0, BM)
                    mask_m = offs_m < m1
                    offs_n = col_block * BN + tl.arange(0, BN)
                    mask_n = offs_n < DIM
                else:
                    expert_offset = (local.to(tl.int64) * weight_rank_stride
                                     + expert.to(tl.int64) * DIM * HIDDEN)
                    y, offs_m, mask_m, offs_n, mask_n = fc2_tile(
                        h_ptr + local.to(tl.int64) * h_rank_stride, w2_ptr + expert_offset,
                        m0, m1, col_block * BN, DIM, HIDDEN, BM, BN, BK, EVEN_K, EVEN_N, PRECISION,
                    )
                if STAGED | PRESUM:
                    staged = y_ptr + local.to(tl.int64) * y_rank_stride
                    tl.store(staged + offs_m[:, None].to(tl.int64) * DIM + offs_n[None, :], y,
                             mask=mask_m[:, None] & mask_n[None, :])
                    tl.debug_barrier()
                    tile_done = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.tile_done)
                    tl.atomic_add(tile_done + tile, 1, sem="release", scope="gpu")
                else:
                    if DEFER_RELEASE:
                        release_token_arrivals(pending_source, pending_token, pending, arena, anchor_rank, SCOPE)
                    if RACE:
                        control = control_ptr + local * _CONTROL_WORDS
                        mask_m = race_rows_delivered(arena, anchor_rank, rank, control, offs_m, mask_m, col_block,
                                                     _SALT_COMBINE)
                    source, token = store_rows_to_sources(
                        y, offs_m, mask_m, offs_n, mask_n,
                        arena_ptr(arena.i32, arena, anchor_rank, rank, arena.slot_copy), arena, anchor_rank,
                        DIM, TOP_K,
                    )
                    if RACE:
                        copy_id = tl.load(arena_ptr(arena.i32, arena, anchor_rank, rank, arena.slot_copy) + offs_m,
                                          mask=mask_m, other=0, cache_modifier=".cg")
                        row = (copy_id % (arena.token_capacity * TOP_K)).to(tl.int64)
                        race_stamp_rows(arena, anchor_rank, control, source, row, col_block, mask_m, COL_BLOCKS)
                    # Every thread's row stores before any arrival is released.
                    tl.debug_barrier()
                    pending_source, pending_token, pending = release_or_defer(
                        source, token, mask_m, pending_source, pending_token, pending, arena, anchor_rank,
                        DEFER_RELEASE, SCOPE)
            task = claim_task(control_ptr, _CTL_FC2_TASKS)
        if DEFER_RELEASE:
            release_token_arrivals(pending_source, pending_token, pending, arena, anchor_rank, SCOPE)

    if PRESUM:
        if do_send != 0:
            total = NUM_LOCAL * max_over_ranks(route.num_tiles, NUM_LOCAL) * (BM // BT)
            task = claim_task(control_ptr, _CTL_SEND_TASKS)
            while task < total:
                presum_task(task, rank_base, control_ptr, route, y_ptr, y_rank_stride, arena, anchor_rank, col_blocks,
                            timeout, NUM_LOCAL, WORLD, DIM, TOP_K, KP, SCORE_BEFORE, BM, BT, BD, USE_TIMER, SCOPE)
                task = claim_task(control_ptr, _CTL_SEND_TASKS)

    if STAGED:
        if do_send != 0:
            total = NUM_LOCAL * max_over_ranks(route.num_tiles, NUM_LOCAL)
            task = claim_task(control_ptr, _CTL_SEND_TASKS)
            while task < total:
                send_task(task, rank_base, control_ptr, route, y_ptr, y_rank_stride, arena, anchor_rank, col_blocks,
                          timeout, NUM_LOCAL, DIM, TOP_K, BM, BD, USE_TIMER, WORLD, RACE, COL_BLOCKS, SCOPE)
                task = claim_task(control_ptr, _CTL_SEND_TASKS)

    if do_reduce != 0:
        tasks_per_rank = tl.cdiv(max_over_ranks(route.num_tokens, NUM_LOCAL), BT)
        total = NUM_LOCAL * tasks_per_rank
        if STAGED:
            arrivals_per_token = TOP_K
        else:
            arrivals_per_token = TOP_K * col_blocks
        task = claim_task(control_ptr, _CTL_REDUCE_TASKS)
        while task < total:
            if PRESUM:
                presum_reduce_task(task, tasks_per_rank, rank_base, control_ptr, route, out_ptr, out_rank_stride,
                                   arena, anchor_rank, timeout, WORLD, DIM, TOP_K, KP, BT, BD, USE_TIMER, SCOPE)
            else:
                reduce_task(task, tasks_per_rank, rank_base, control_ptr, route, scores_ptr, out_ptr, out_rank_stride,
                            arena, anchor_rank, arrivals_per_token, timeout, DIM, TOP_K, SCORE_BEFORE, BT, BD,
                            USE_TIMER, WORLD, RACE, SLACK, COL_BLOCKS, SCOPE)
            task = claim_task(control_ptr, _CTL_REDUCE_TASKS)
