"""Megakernel A: dispatch + grouped GEMM fc1 (w1, w3) + SwiGLU.

Index arrays (``L`` local ranks: 1 for real EP, ``W`` for the simulated
world, where every per-rank array is stacked on a leading rank dimension):

- source side, ``(L, T, K)``: ``dest_rank``/``dest_slot``/``dest_tile`` int32
  from ``layout.compute_layout``/``compute_tiles``, ``scores`` fp32;
- receive side, ``(L, C)`` int32: ``tile_expert``, ``tile_start``,
  ``tile_end`` and ``num_tiles`` ``(L,)``;
- in every rank's symmetric arena: ``tokens`` ``(W * T_cap, D)``, the
  de-duplicated token rows (source ``s``'s token ``t`` at row
  ``s * T_cap + t``, ``layout.token_row``); ``slot_copy`` ``(S,) int32``, for
  each receive slot the copy id ``(s * T_cap + t) * K + k`` it holds (its token
  row is ``copy // K``); ``slot_score`` ``(S,) fp32``; ``tile_arrivals``
  ``(C,) int32``, slots of each tile that have arrived.

Tasks, claimed from atomic counters by a persistent grid:

1. Dispatch task (``comm_block_tokens`` tokens of one source rank): copy each
   token's row once to every rank that owns one of its experts, write the
   slot entries of its copies there, then release one arrival per copy on the
   copy's tile. Run by the first ``num_comm_sms`` programs only.
2. fc1 task (tile of one local expert x ``block_n_fc1`` columns of h): wait
   (acquire, bounded) until all the tile's slots arrived, gather their token
   rows, scale them by the router score when scores come before the experts
   (TorchTitan: ``(x.float() * score).to(x.dtype)``), compute
   ``h = silu(x @ w1^T) * (x @ w3^T)`` with TorchTitan's rounding steps, and
   store h at the tile's slots.

Sequential schedule: the same kernel launched twice (dispatch tasks only, then
fc1 tasks only). Both schedules run the same compiled tile code on the same
slots, so h is bitwise identical; only *when* a tile runs differs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .sync import (
    CONTROL_WORDS,
    CTL_DISPATCH_TASKS,
    CTL_FC1_TASKS,
    CTL_OWN_DISPATCH_TASKS,
    BAD_SLOT,
    WAIT_TILE_ROWS,
    arena_ptr,
    has_failed,
    next_task,
    record_failure,
    wait_counter_at_least,
)

_CTL_DISPATCH_TASKS = tl.constexpr(CTL_DISPATCH_TASKS)
_CTL_FC1_TASKS = tl.constexpr(CTL_FC1_TASKS)
_CTL_OWN_DISPATCH_TASKS = tl.constexpr(CTL_OWN_DISPATCH_TASKS)
_BAD_SLOT = tl.constexpr(BAD_SLOT)
_WAIT_TILE_ROWS = tl.constexpr(WAIT_TILE_ROWS)
_CONTROL_WORDS = tl.constexpr(CONTROL_WORDS)


@triton.jit
def grouped_tile_task(task, num_tiles, num_col_blocks, GROUP_M: tl.constexpr):
    """Task id -> (row tile, column block), ``GROUP_M`` row tiles at a time."""
    width = GROUP_M * num_col_blocks
    first = (task // width) * GROUP_M
    group_size = tl.minimum(num_tiles - first, GROUP_M)
    tile = first + (task % width) % group_size
    col_block = (task % width) // group_size
    return tile, col_block


@triton.jit
def dispatch_part(dest, rank, part):
    """Which copies a dispatch task handles: all (``part`` 0), those that stay
    on ``rank`` itself (1) or those that go to other ranks (2)."""
    own = dest == rank
    which = rank * 0 + part  # a tensor, whether ``part`` is a constant or not
    return (which == 0) | ((which == 1) & own) | ((which == 2) & (own == 0))


@triton.jit
def store_rows_to_peers(
    x_rows, dest, act_anchor, arena_ptrs, anchor_rank, off_tokens, token_rows, mask_t, rank, part,
    WORLD: tl.constexpr, DIM: tl.constexpr, BD: tl.constexpr,
):
    """Copy a block of token rows once to each rank that owns one of its
    experts (of the ranks ``dispatch_part`` selects)."""
    for d0 in range(0, DIM, BD):
        offs_d = d0 + tl.arange(0, BD)
        mask_d = offs_d < DIM
        rows = tl.load(x_rows + offs_d[None, :], mask=mask_t[:, None] & mask_d[None, :])
        for peer in range(WORLD):
            goes_there = (tl.max(tl.where(dest == peer, 1, 0), axis=1) > 0) & dispatch_part(peer, rank, part)
            tokens = arena_ptr(act_anchor, arena_ptrs, anchor_rank, peer, off_tokens)
            tl.store(
                tokens + token_rows[:, None] * DIM + offs_d[None, :],
                rows,
                mask=goes_there[:, None] & mask_d[None, :],
            )


@triton.jit
def dispatch_task(
    task, tasks_per_rank, rank_base, control_ptr, num_tokens_ptr,
    x_ptr, x_rank_stride, scores_ptr, dest_rank_ptr, dest_slot_ptr, dest_tile_ptr, route_rank_stride,
    arena_ptrs, act_anchor, i32_anchor, f32_anchor, anchor_rank,
    off_tokens, off_slot_copy, off_slot_score, off_tile_arrivals, off_token_slots, off_token_tiles,
    token_capacity, slot_capacity, tile_capacity, silent_rank, part,
    WORLD: tl.constexpr, DIM: tl.constexpr, TOP_K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, KP: tl.constexpr,
    PRESUM: tl.constexpr,
):
    """``comm_block_tokens`` tokens of one source rank: their rows, slot
    entries and tile arrivals, for the destinations ``part`` selects
    (``dispatch_part``)."""
    local = task // tasks_per_rank
    rank = rank_base + local
    control = control_ptr + local * _CONTROL_WORDS
    num_tokens = tl.load(num_tokens_ptr + local)
    if (rank != silent_rank) & (has_failed(control) == 0):
        offs_t = (task % tasks_per_rank) * BT + tl.arange(0, BT)
        mask_t = offs_t < num_tokens
        offs_k = tl.arange(0, KP)
        mask_tk = mask_t[:, None] & (offs_k < TOP_K)[None, :]
        route = local * route_rank_stride + offs_t[:, None] * TOP_K + offs_k[None, :]
        dest = tl.load(dest_rank_ptr + route, mask=mask_tk, other=-1)
        token_rows = rank.to(tl.int64) * token_capacity + offs_t
        x_rows = x_ptr + local.to(tl.int64) * x_rank_stride + offs_t[:, None].to(tl.int64) * DIM
        store_rows_to_peers(x_rows, dest, act_anchor, arena_ptrs, anchor_rank, off_tokens, token_rows, mask_t, rank,
                            part, WORLD, DIM, BD)
        every_copy = mask_tk
        mask_tk = mask_tk & dispatch_part(dest, rank, part)

        slot = tl.load(dest_slot_ptr + route, mask=mask_tk, other=0)
        tile = tl.load(dest_tile_ptr + route, mask=mask_tk, other=0)
        fits = (slot >= 0) & (slot < slot_capacity) & (tile >= 0) & (tile < tile_capacity)
        bad = mask_tk & (fits == 0)
        if tl.max(bad.to(tl.int32)) > 0:
            first_bad = tl.min(tl.where(bad, offs_t[:, None], 1 << 30))
            record_failure(control, rank, task, _BAD_SLOT, first_bad, slot_capacity, tl.max(tl.where(bad, slot, 0)))
        ok = mask_tk & fits
        peer = tl.maximum(dest, 0)
        copy_id = token_rows[:, None] * TOP_K + offs_k[None, :]
        slot_copy = arena_ptr(i32_anchor, arena_ptrs, anchor_rank, peer, off_slot_copy)
        tl.store(slot_copy + slot, copy_id.to(tl.int32), mask=ok)
        score = tl.load(scores_ptr + route, mask=mask_tk, other=0.0)
        tl.store(arena_ptr(f32_anchor, arena_ptrs, anchor_rank, peer, off_slot_score) + slot, score, mask=ok)
        if PRESUM:
            # Presum combine: every rank a token goes to learns, per k, the slot
            # (and tile) of the token's copy there, or -1: all K entries of a
            # token are written this call, before its arrivals are released.
            for p in range(WORLD):
                here = dest == p
                goes_there = tl.max(tl.where(here, 1, 0), axis=1) > 0
                entry = every_copy & goes_there[:, None] & dispatch_part(p, rank, part)
                token_slots = arena_ptr(i32_anchor, arena_ptrs, anchor_rank, p, off_token_slots)
                tl.store(token_slots + copy_id, tl.where(here & fits, slot, -1), mask=entry)
                token_tiles = arena_ptr(i32_anchor, arena_ptrs, anchor_rank, p, off_token_tiles)
                tl.store(token_tiles + copy_id, tl.where(here & fits, tile, -1), mask=entry)
        # Every thread's row and slot stores before any arrival is released.
        tl.debug_barrier()
        tile_arrivals = arena_ptr(i32_anchor, arena_ptrs, anchor_rank, peer, off_tile_arrivals)
        tl.atomic_add(tile_arrivals + tile, 1, mask=ok, sem="release", scope="sys")


@triton.jit
def fc1_tile(
    tokens, slot_copy, slot_score, w1, w3, h, h13, m0, m1, n0,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, SCORE_BEFORE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr, SAVE_H13: tl.constexpr,
):
    """h[m0:m1, n0:n0+BN] of one expert; ``w1``/``w3`` point at its (H, D)
    weights. ``SAVE_H13``: also h1 and h3 (rounded) into ``h13`` ``(S, 2H)``
    rows, for the backward."""
    offs_m = m0 + tl.arange(0, BM)
    mask_m = offs_m < m1
    offs_n = n0 + tl.arange(0, BN)
    mask_n = offs_n < HIDDEN
    offs_k = tl.arange(0, BK)
    copy_id = tl.load(slot_copy + offs_m, mask=mask_m, other=0, cache_modifier=".cg")
    token_row = (copy_id // TOP_K).to(tl.int64)
    a_ptrs = tokens + token_row[:, None] * DIM + offs_k[None, :]
    b1_ptrs = w1 + offs_n[None, :].to(tl.int64) * DIM + offs_k[:, None]
    b3_ptrs = w3 + offs_n[None, :].to(tl.int64) * DIM + offs_k[:, None]
    if SCORE_BEFORE:
        score = tl.load(slot_score + offs_m, mask=mask_m, other=0.0, cache_modifier=".cg")
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(DIM, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0, cache_modifier=".cg")
            if EVEN_N:
                b1 = tl.load(b1_ptrs)
                b3 = tl.load(b3_ptrs)
            else:
                b1 = tl.load(b1_ptrs, mask=mask_n[None, :], other=0.0)
                b3 = tl.load(b3_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < DIM - k * BK
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0, cache_modifier=".cg")
            b1 = tl.load(b1_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            b3 = tl.load(b3_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if SCORE_BEFORE:
            a = (a.to(tl.float32) * score[:, None]).to(a.dtype)
        acc1 = tl.dot(a, b1, acc1, input_precision=PRECISION)
        acc3 = tl.dot(a, b3, acc3, input_precision=PRECISION)
        a_ptrs += BK
        b1_ptrs += BK
        b3_ptrs += BK
    # TorchTitan: h = silu(grouped_mm(x, w1)) * grouped_mm(x, w3), each result
    # rounded to the activation dtype; torch's silu is x / (1 + exp(-x)) in fp32.
    out_ty = h.dtype.element_ty
    gate = acc1.to(out_ty).to(tl.float32)
    up = acc3.to(out_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    tl.store(
        h + offs_m[:, None].to(tl.int64) * HIDDEN + offs_n[None, :],
        (act * up).to(out_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )
    if SAVE_H13:
        saved = h13 + offs_m[:, None].to(tl.int64) * (2 * HIDDEN) + offs_n[None, :]
        tl.store(saved, acc1.to(out_ty), mask=mask_m[:, None] & mask_n[None, :])
        tl.store(saved + HIDDEN, acc3.to(out_ty), mask=mask_m[:, None] & mask_n[None, :])


# Runtime scalars that differ between launches of one call (schedule phases,
# ranks) must not be specialised: both schedules then run one compiled binary.
@triton.jit(do_not_specialize=["anchor_rank", "rank_base", "do_dispatch", "do_fc1", "num_dispatch_programs", "silent_rank",
                               "timeout", "local_first"])
def dispatch_fc1_kernel(
    x_ptr,  # (L, T, D) activations
    x_rank_stride,
    scores_ptr,  # (L, T, K) fp32 router scores
    dest_rank_ptr,  # (L, T, K) int32
    dest_slot_ptr,  # (L, T, K) int32
    dest_tile_ptr,  # (L, T, K) int32
    route_rank_stride,
    num_tokens_ptr,  # (L,) int32
    tile_expert_ptr,  # (L, C) int32
    tile_start_ptr,  # (L, C) int32
    tile_end_ptr,  # (L, C) int32
    tile_rank_stride,
    num_tiles_ptr,  # (L,) int32
    tile_order_ptr,  # (L, C) int32: tile ids, own-rows tiles first (local_first)
    w1_ptr,  # (L, El, H, D)
    w3_ptr,  # (L, El, H, D)
    weight_rank_stride,
    h_ptr,  # (L, S, H) out, expert-major slots
    h_rank_stride,
    h13_ptr,  # (L, S, 2H) out when SAVE_H13: h1 | h3 per slot (any pointer otherwise)
    h13_rank_stride,
    control_ptr,  # (L, CONTROL_WORDS) int64
    arena_ptrs,  # (W,) int64 arena base addresses
    act_anchor,  # arena of anchor_rank, as the activation dtype
    i32_anchor,  # the same, as int32
    f32_anchor,  # the same, as fp32
    anchor_rank,
    off_tokens,  # element offsets of the arena buffers (in their own dtype)
    off_slot_copy,
    off_slot_score,
    off_tile_arrivals,
    off_token_slots,
    off_token_tiles,
    rank_base,
    token_capacity,
    slot_capacity,
    tile_capacity,
    do_dispatch,
    do_fc1,
    num_dispatch_programs,
    silent_rank,
    timeout,
    local_first,  # KernelConfig.local_first: own rows dispatched first by every program, tiles in tile_order
    NUM_LOCAL: tl.constexpr,
    WORLD: tl.constexpr,
    DIM: tl.constexpr,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    SCORE_BEFORE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    KP: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TIMER: tl.constexpr,
    PRESUM: tl.constexpr = False,
    SAVE_H13: tl.constexpr = False,
):
    pid = tl.program_id(0)
    if do_dispatch != 0:
        max_tokens = 0
        for local in range(NUM_LOCAL):
            max_tokens = tl.maximum(max_tokens, tl.load(num_tokens_ptr + local))
        tasks_per_rank = tl.cdiv(max_tokens, BT)
        total = NUM_LOCAL * tasks_per_rank
        # Pass 0 (local_first only): every program copies the rows that stay on this
        # rank (no NVLink), so the tiles holding only those (first in tile_order) can
        # start while, in pass 1, the first num_dispatch_programs programs send the
        # others (every row when local_first is off).
        for step in tl.static_range(2):
            # (arithmetic on the static step: the compiler takes no branch-defined constexpr)
            counter = _CTL_DISPATCH_TASKS + (_CTL_OWN_DISPATCH_TASKS - _CTL_DISPATCH_TASKS) * (1 - step)
            first = (local_first != 0).to(tl.int32)
            part = (1 - step) + step * 2 * first
            active = (1 - step) * first + step * (pid < num_dispatch_programs).to(tl.int32)
            if active != 0:
                task = next_task(control_ptr, counter)
                while task < total:
                    dispatch_task(
                        task, tasks_per_rank, rank_base, control_ptr, num_tokens_ptr,
                        x_ptr, x_rank_stride, scores_ptr, dest_rank_ptr, dest_slot_ptr, dest_tile_ptr,
                        route_rank_stride, arena_ptrs, act_anchor, i32_anchor, f32_anchor, anchor_rank,
                        off_tokens, off_slot_copy, off_slot_score, off_tile_arrivals, off_token_slots, off_token_tiles,
                        token_capacity, slot_capacity, tile_capacity, silent_rank, part,
                        WORLD, DIM, TOP_K, BT, BD, KP, PRESUM,
                    )
                    task = next_task(control_ptr, counter)

    if do_fc1 != 0:
        col_blocks = tl.cdiv(HIDDEN, BN)
        max_tiles = 0
        for local in range(NUM_LOCAL):
            max_tiles = tl.maximum(max_tiles, tl.load(num_tiles_ptr + local))
        # Local ranks interleaved: task -> (task % L, task // L).
        total = NUM_LOCAL * max_tiles * col_blocks
        task = next_task(control_ptr, _CTL_FC1_TASKS)
        while task < total:
            local = task % NUM_LOCAL
            rank = rank_base + local
            control = control_ptr + local * _CONTROL_WORDS
            num_tiles = tl.load(num_tiles_ptr + local)
            rank_task = task // NUM_LOCAL
            if (rank_task < num_tiles * col_blocks) & (has_failed(control) == 0):
                tile, col_block = grouped_tile_task(rank_task, num_tiles, col_blocks, GROUP_M)
                if local_first != 0:
                    tile = tl.load(tile_order_ptr + local * tile_rank_stride + tile)
                expert = tl.load(tile_expert_ptr + local * tile_rank_stride + tile)
                m0 = tl.load(tile_start_ptr + local * tile_rank_stride + tile)
                m1 = tl.load(tile_end_ptr + local * tile_rank_stride + tile)
                arrivals = arena_ptr(i32_anchor, arena_ptrs, anchor_rank, rank, off_tile_arrivals) + tile
                seen = wait_counter_at_least(arrivals, m1 - m0, timeout, USE_TIMER)
                if seen < m1 - m0:
                    record_failure(control, rank, task, _WAIT_TILE_ROWS, tile, m1 - m0, seen)
                elif m1 <= slot_capacity:
                    expert_offset = local.to(tl.int64) * weight_rank_stride + expert.to(tl.int64) * HIDDEN * DIM
                    fc1_tile(
                        arena_ptr(act_anchor, arena_ptrs, anchor_rank, rank, off_tokens),
                        arena_ptr(i32_anchor, arena_ptrs, anchor_rank, rank, off_slot_copy),
                        arena_ptr(f32_anchor, arena_ptrs, anchor_rank, rank, off_slot_score),
                        w1_ptr + expert_offset,
                        w3_ptr + expert_offset,
                        h_ptr + local.to(tl.int64) * h_rank_stride,
                        h13_ptr + local.to(tl.int64) * h13_rank_stride,
                        m0, m1, col_block * BN, DIM, HIDDEN, TOP_K,
                        SCORE_BEFORE, BM, BN, BK, EVEN_K, EVEN_N, PRECISION, SAVE_H13,
                    )
            task = next_task(control_ptr, _CTL_FC1_TASKS)
