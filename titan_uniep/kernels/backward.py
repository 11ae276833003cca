"""Backward megakernels of one MoE layer's routed-expert path.

Same layout, tiles and scoreboard as the forward (``dispatch_fc1``,
``fc2_combine``); the backward has its own symmetric workspace whose token
rows are ``2 * D`` wide: ``[x | dOut]`` of one source token, so one
de-duplicated row copy carries both the saved input and the output gradient.

Index arrays (``L`` local ranks, stacked as in the forward):

- source side ``(L, T, K)``: ``dest_rank``/``dest_slot``/``dest_tile`` int32,
  ``scores`` fp32; ``x``/``grad_out`` ``(L, T, D)``;
- receive side ``(L, C)`` int32 ``tile_expert``/``tile_start``/``tile_end``,
  ``num_tiles`` ``(L,)``, ``route_tables`` ``(L, 5, E)`` int32 (each local
  expert's first slot and row count, ``kernels.route``); all written by the
  forward's route kernels, run on the backward workspace;
- arena (every rank): ``tokens`` ``(W * T_cap, 2D)`` (``[x | dOut]`` rows),
  ``slot_copy``/``slot_score`` ``(S,)``, ``tile_arrivals`` ``(C,)``,
  ``returned`` ``(T_cap * K, 2D)``: columns ``[0, D)`` the dA row of copy
  ``(t, k)``, the next fp32 word its router-score gradient (scores after the
  experts), ``token_arrivals``.
- local: ``h``, ``dh1``, ``dh3`` ``(L, S, H)``; ``ds_parts`` ``(L, S, NHB)``
  fp32, one router-score partial per slot and dH column block.

Megakernel BA (dispatch + dH + SwiGLU backward), tasks:

1. dispatch (``comm_block_tokens`` tokens): copy each token's ``[x | dOut]``
   row once to every rank owning one of its experts, write slot entries,
   release one arrival per copy on its tile;
2. tile (expert rows ``m0..m1`` x ``BN_A`` columns of H): wait for the tile's
   rows, recompute ``h1 = a @ w1^T``, ``h3 = a @ w3^T`` (``a`` = x row, times
   the score when scores come before the experts, as the forward),
   ``G = dOut @ w2`` (the dispatched, unscaled rows), ``dH = s * G`` (scores
   after the experts) or ``G`` (before), then store ``h`` (``s * h`` after the
   experts: the weight gradient takes ``dW2 = dOut^T (s * h)``),
   ``dh1 = dH * h3 * silu'(h1)``, ``dh3 = dH * silu(h1)`` with torch
   autograd's rounding steps; scores after the experts, also the partial
   router-score gradient ``sum_n G[:, n] * h[:, n]`` over the tile's columns
   (``<dOut, y> = <dOut @ w2, h>`` for ``y = h @ w2^T``: no second fc2).

Megakernel BB (dA + combine), tasks:

1. tile (expert rows x ``BN_B`` columns of D): ``dA = dh1 @ w1 + dh3 @ w3``
   (one fp32 accumulator), stored into the source's ``returned[t * K + k]``;
   scores after the experts, the tiles of column block 0 also sum each row's
   ``NHB`` score partials in column-block order and store the sum next to
   it; then one release arrival per row on the source's
   ``token_arrivals[t]``;
2. reduce (``reduce_block_tokens`` tokens): wait for ``K * cdiv(D, BN_B)``
   arrivals per token, then in fp32 and fixed order ``k = 0..K-1``:
   ``dx = sum_k dA`` (after) or ``sum_k s * dA`` (before), and
   ``ds`` = the returned sum (after) or ``<x, dA>`` (before, in column order
   of ``BD`` blocks).

The weight gradients need no communication once BA has run: they are their
own launches (``kernels.wgrad``), the same in both schedules.

Each call starts with the forward's route kernels on the backward workspace
(``fused._route``: histogram, counts exchange, layout): the same
deterministic slots as the forward, and the exchange zeroes this call's
arrival and task counters (the backward's counters below are among
the control words ``sync.TASK_COUNTER_WORDS``, which it zeroes).

Sequential schedule: the same kernels, one task kind per launch. Fused: BA
with dispatch and tiles, BB with tiles and reduce. Same binaries, same tiles,
same slots: bitwise equal gradients.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dispatch_fc1 import dispatch_part, grouped_tile_task
from .fc2_combine import matrix_descriptor, release_or_defer, release_token_arrivals
from .route import used_slots
from .wgrad import copy_slot_rows
from .sync import (
    BAD_SLOT,
    CONTROL_WORDS,
    CTL_OWN_DISPATCH_TASKS,
    TASK_COUNTER_WORDS,
    WAIT_TILE_ROWS,
    WAIT_TOKEN_ROWS,
    arena_ptr,
    has_failed,
    next_task,
    record_failure,
    wait_counter_at_least,
    wait_counters_at_least,
)

# Task counters of the backward workspace's control words (the counts exchange
# zeroes every word of sync.TASK_COUNTER_WORDS each call).
CTL_BWD_DISPATCH = 0
CTL_BWD_DH = 1
CTL_BWD_DA = 2
CTL_BWD_REDUCE = 3
CTL_BWD_OWN_DISPATCH = CTL_OWN_DISPATCH_TASKS
assert {CTL_BWD_DISPATCH, CTL_BWD_DH, CTL_BWD_DA, CTL_BWD_REDUCE, CTL_BWD_OWN_DISPATCH} <= set(TASK_COUNTER_WORDS)

_CTL_BWD_DISPATCH = tl.constexpr(CTL_BWD_DISPATCH)
_CTL_BWD_OWN_DISPATCH = tl.constexpr(CTL_BWD_OWN_DISPATCH)
_CTL_BWD_DH = tl.constexpr(CTL_BWD_DH)
_CTL_BWD_DA = tl.constexpr(CTL_BWD_DA)
_CTL_BWD_REDUCE = tl.constexpr(CTL_BWD_REDUCE)
_BAD_SLOT = tl.constexpr(BAD_SLOT)
_WAIT_TILE_ROWS = tl.constexpr(WAIT_TILE_ROWS)
_WAIT_TOKEN_ROWS = tl.constexpr(WAIT_TOKEN_ROWS)
_CONTROL_WORDS = tl.constexpr(CONTROL_WORDS)


@triton.jit
def dispatch_grad_task(
    task, tasks_per_rank, rank_base, control_ptr, num_tokens_ptr,
    x_ptr, g_ptr, x_rank_stride, scores_ptr, dest_rank_ptr, dest_slot_ptr, dest_tile_ptr, route_rank_stride,
    arena_ptrs, act_anchor, i32_anchor, f32_anchor, anchor_rank,
    off_tokens, off_slot_copy, off_slot_score, off_tile_arrivals,
    token_capacity, slot_capacity, tile_capacity, silent_rank, part,
    WORLD: tl.constexpr, DIM: tl.constexpr, TOP_K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    KP: tl.constexpr,
):
    """Send ``BT`` tokens' ``[x | dOut]`` rows once per destination rank, then
    signal their copies' tiles (for the destinations ``part`` selects:
    ``dispatch_fc1.dispatch_part``)."""
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
        mask_tk = mask_tk & dispatch_part(dest, rank, part)
        src = local.to(tl.int64) * x_rank_stride + offs_t[:, None].to(tl.int64) * DIM
        for d0 in range(0, DIM, BD):
            offs_d = d0 + tl.arange(0, BD)
            mask_d = offs_d < DIM
            mask = mask_t[:, None] & mask_d[None, :]
            x_rows = tl.load(x_ptr + src + offs_d[None, :], mask=mask)
            g_rows = tl.load(g_ptr + src + offs_d[None, :], mask=mask)
            for peer in range(WORLD):
                goes_there = (tl.max(tl.where(dest == peer, 1, 0), axis=1) > 0) & dispatch_part(peer, rank, part)
                tokens = arena_ptr(act_anchor, arena_ptrs, anchor_rank, peer, off_tokens)
                dst = tokens + token_rows[:, None] * (2 * DIM) + offs_d[None, :]
                there = goes_there[:, None] & mask_d[None, :]
                tl.store(dst, x_rows, mask=there)
                tl.store(dst + DIM, g_rows, mask=there)

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
        tl.store(arena_ptr(i32_anchor, arena_ptrs, anchor_rank, peer, off_slot_copy) + slot, copy_id.to(tl.int32),
                 mask=ok)
        score = tl.load(scores_ptr + route, mask=mask_tk, other=0.0)
        tl.store(arena_ptr(f32_anchor, arena_ptrs, anchor_rank, peer, off_slot_score) + slot, score, mask=ok)
        tl.debug_barrier()  # every row and slot store before any arrival
        tile_arrivals = arena_ptr(i32_anchor, arena_ptrs, anchor_rank, peer, off_tile_arrivals)
        tl.atomic_add(tile_arrivals + tile, 1, mask=ok, sem="release", scope="sys")


@triton.jit
def _operands3(a_ptrs, b_ptrs, c_ptrs, mask_m, mask_n, offs_k, k, DIM: tl.constexpr, BK: tl.constexpr,
               EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, ONE_WEIGHT: tl.constexpr):
    """One K step's gathered rows ``a`` (BM x BK) and weight tiles ``b``, ``c``
    (BK x BN pointer blocks; ``ONE_WEIGHT``: ``c`` is ``b``), masked as the
    shape needs."""
    if EVEN_K:
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0, cache_modifier=".cg")
        if EVEN_N:
            b = tl.load(b_ptrs)
            c = b if ONE_WEIGHT else tl.load(c_ptrs)
        else:
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
            c = b if ONE_WEIGHT else tl.load(c_ptrs, mask=mask_n[None, :], other=0.0)
    else:
        mask_k = offs_k < DIM - k * BK
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0, cache_modifier=".cg")
        mask_kn = mask_k[:, None] & mask_n[None, :]
        b = tl.load(b_ptrs, mask=mask_kn, other=0.0)
        c = b if ONE_WEIGHT else tl.load(c_ptrs, mask=mask_kn, other=0.0)
    return a, b, c


@triton.jit
def _grad_out_w2(acc, tokens, token_row, w2, mask_m, mask_n, offs_n, offs_k, DIM: tl.constexpr,
                 HIDDEN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                 PRECISION: tl.constexpr):
    """acc += dOut rows (the dispatched ``[x | dOut]`` rows' second half) @ w2
    columns ``offs_n``: the K-loop over D of its own (pointers built here, so
    they are not live across an earlier loop)."""
    dy_ptrs = tokens + token_row[:, None] * (2 * DIM) + DIM + offs_k[None, :]
    b2_ptrs = w2 + offs_k[:, None].to(tl.int64) * HIDDEN + offs_n[None, :]
    for k in range(0, tl.cdiv(DIM, BK)):
        dy, b2, _unused = _operands3(dy_ptrs, b2_ptrs, b2_ptrs, mask_m, mask_n, offs_k, k, DIM, BK, EVEN_K, EVEN_N,
                                     True)
        acc = tl.dot(dy, b2, acc, input_precision=PRECISION)
        dy_ptrs += BK
        b2_ptrs += BK * HIDDEN
    return acc


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
    tokens, slot_copy, slot_score, w1, w2, w3, h, dh1, dh3, ds_parts, h13, g32, m0, m1, col_block,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, SCORE_BEFORE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TWO_PASS: tl.constexpr, SAVED_H13: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """h (times the score, scores after), dh1, dh3 and the score partials at
    slots ``m0..m1``, columns ``col_block * BN + [0, BN)`` of one expert
    (``w1``/``w3``: its (H, D), ``w2``: its (D, H)). The K-loops over D have
    compile-time trip counts and advancing pointers (software-pipelined: the
    gathered ``[x | dOut]`` rows and the weight tiles are async copies).
    ``TWO_PASS``: one loop for h1/h3, then one for G (a wider tile, the
    gathered rows read twice); else all three in one loop. ``SAVED_H13``: h1
    and h3 come from the forward (``h13`` ``(S, 2H)``): the tile is one loop
    for G and stores it in fp32 (``g32`` ``(S, H)``); ``swiglu_backward_kernel``
    then does the rest (an epilogue here would be a streaming pass at a
    fraction of the memory bandwidth, with nothing to overlap it)."""
    EVEN_K: tl.constexpr = DIM % BK == 0
    EVEN_N: tl.constexpr = HIDDEN % BN == 0
    NHB: tl.constexpr = (HIDDEN + BN - 1) // BN
    offs_m = m0 + tl.arange(0, BM)
    mask_m = offs_m < m1
    offs_n = col_block * BN + tl.arange(0, BN)
    mask_n = offs_n < HIDDEN
    offs_k = tl.arange(0, BK)
    out_ty = h.dtype.element_ty
    copy_id = tl.load(slot_copy + offs_m, mask=mask_m, other=0, cache_modifier=".cg")
    token_row = (copy_id // TOP_K).to(tl.int64)
    score = tl.load(slot_score + offs_m, mask=mask_m, other=0.0, cache_modifier=".cg")
    a_ptrs = tokens + token_row[:, None] * (2 * DIM) + offs_k[None, :]
    b1_ptrs = w1 + offs_n[None, :].to(tl.int64) * DIM + offs_k[:, None]
    b3_ptrs = w3 + offs_n[None, :].to(tl.int64) * DIM + offs_k[:, None]
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    acc_dh = tl.zeros((BM, BN), dtype=tl.float32)
    # TorchTitan's (x.float() * s).to(x.dtype) before the experts; after them
    # the score scales the fp32 product G = dOut @ w2 (epilogue).
    if SAVED_H13:
        acc_dh = _grad_out_w2(acc_dh, tokens, token_row, w2, mask_m, mask_n, offs_n, offs_k, DIM, HIDDEN, BK,
                              EVEN_K, EVEN_N, PRECISION)
        at = offs_m[:, None].to(tl.int64) * HIDDEN + offs_n[None, :]
        tl.store(g32 + at, acc_dh, mask=mask_m[:, None] & mask_n[None, :])
    elif TWO_PASS:
        # h1, h3 first (two accumulators), then G (one): three BN-wide
        # accumulators never live at once, so BN can be 128. The gathered
        # rows are read twice (L2).
        for k in range(0, tl.cdiv(DIM, BK)):
            a, b1, b3 = _operands3(a_ptrs, b1_ptrs, b3_ptrs, mask_m, mask_n, offs_k, k, DIM, BK, EVEN_K, EVEN_N,
                                   False)
            if SCORE_BEFORE:
                a = (a.to(tl.float32) * score[:, None]).to(a.dtype)
            acc1 = tl.dot(a, b1, acc1, input_precision=PRECISION)
            acc3 = tl.dot(a, b3, acc3, input_precision=PRECISION)
            a_ptrs += BK
            b1_ptrs += BK
            b3_ptrs += BK
        # h1 and h3 stay in registers, rounded, across the second loop (ptxas
        # spills ~0.5 KB at BN = 128; still faster than BN = 64 in one loop).
        gate_lp = acc1.to(out_ty)
        up_lp = acc3.to(out_ty)
        acc_dh = _grad_out_w2(acc_dh, tokens, token_row, w2, mask_m, mask_n, offs_n, offs_k, DIM, HIDDEN, BK,
                              EVEN_K, EVEN_N, PRECISION)
    else:
        b2_ptrs = w2 + offs_k[:, None].to(tl.int64) * HIDDEN + offs_n[None, :]
        for k in range(0, tl.cdiv(DIM, BK)):
            a, b1, b3 = _operands3(a_ptrs, b1_ptrs, b3_ptrs, mask_m, mask_n, offs_k, k, DIM, BK, EVEN_K, EVEN_N,
                                   False)
            dy, b2, _unused = _operands3(a_ptrs + DIM, b2_ptrs, b2_ptrs, mask_m, mask_n, offs_k, k, DIM, BK,
                                         EVEN_K, EVEN_N, True)
            if SCORE_BEFORE:
                a = (a.to(tl.float32) * score[:, None]).to(a.dtype)
            acc1 = tl.dot(a, b1, acc1, input_precision=PRECISION)
            acc3 = tl.dot(a, b3, acc3, input_precision=PRECISION)
            acc_dh = tl.dot(dy, b2, acc_dh, input_precision=PRECISION)
            a_ptrs += BK
            b1_ptrs += BK
            b3_ptrs += BK
            b2_ptrs += BK * HIDDEN
        gate_lp = acc1.to(out_ty)
        up_lp = acc3.to(out_ty)
    if not SAVED_H13:
        _swiglu_grad(acc_dh, gate_lp, up_lp, score, offs_m, mask_m, offs_n, mask_n, h, dh1, dh3, ds_parts,
                     col_block, HIDDEN, NHB, SCORE_BEFORE)


@triton.jit(do_not_specialize=["anchor_rank", "rank_base", "do_dispatch", "do_tiles", "num_dispatch_programs",
                               "silent_rank", "timeout", "local_first"])
def dispatch_grad_hidden_kernel(
    x_ptr,  # (L, T, D) saved forward input
    g_ptr,  # (L, T, D) output gradient
    x_rank_stride,
    scores_ptr,  # (L, T, K) fp32
    dest_rank_ptr,  # (L, T, K) int32
    dest_slot_ptr,  # (L, T, K) int32
    dest_tile_ptr,  # (L, T, K) int32
    route_rank_stride,
    num_tokens_ptr,  # (L,) int32
    tile_expert_ptr,  # (L, C) int32
    tile_start_ptr,
    tile_end_ptr,
    tile_rank_stride,
    num_tiles_ptr,  # (L,) int32
    tile_order_ptr,  # (L, C) int32: tile ids, own-rows tiles first (local_first)
    w1_ptr,  # (L, El, H, D)
    w2_ptr,  # (L, El, D, H)
    w3_ptr,  # (L, El, H, D)
    weight_rank_stride,
    h_ptr,  # (L, S, H) out
    dh1_ptr,  # (L, S, H) out
    dh3_ptr,  # (L, S, H) out
    h_rank_stride,
    ds_parts_ptr,  # (L, S, NHB) fp32 out (scores after the experts)
    ds_parts_rank_stride,
    h13_ptr,  # (L, S, 2H) h1 | h3 saved by the forward (SAVED_H13; any pointer otherwise)
    h13_rank_stride,
    g32_ptr,  # (L, S, H) fp32 out: G = dOut @ w2 per slot (SAVED_H13; any pointer otherwise), h_rank_stride
    slot_rows_ptr,  # (L, 2, S, D) out: dense [xs, dys] slot rows (COPY_ROWS; any pointer otherwise)
    slot_rows_rank_stride,
    control_ptr,  # (L, CONTROL_WORDS) int64
    arena_ptrs,  # (W,) int64
    act_anchor,
    i32_anchor,
    f32_anchor,
    anchor_rank,
    off_tokens,
    off_slot_copy,
    off_slot_score,
    off_tile_arrivals,
    rank_base,
    token_capacity,
    slot_capacity,
    tile_capacity,
    do_dispatch,
    do_tiles,
    num_dispatch_programs,
    silent_rank,
    timeout,
    local_first,  # KernelConfig.local_first (as megakernel A)
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
    TWO_PASS: tl.constexpr,
    SAVED_H13: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TIMER: tl.constexpr,
    COPY_ROWS: tl.constexpr = False,
    BDC: tl.constexpr = 64,
):
    pid = tl.program_id(0)
    if do_dispatch != 0:
        max_tokens = 0
        for local in range(NUM_LOCAL):
            max_tokens = tl.maximum(max_tokens, tl.load(num_tokens_ptr + local))
        tasks_per_rank = tl.cdiv(max_tokens, BT)
        total = NUM_LOCAL * tasks_per_rank
        for step in tl.static_range(2):  # as megakernel A: own rows by every program first, then the others
            # (arithmetic on the static step: the compiler takes no branch-defined constexpr)
            counter = _CTL_BWD_DISPATCH + (_CTL_BWD_OWN_DISPATCH - _CTL_BWD_DISPATCH) * (1 - step)
            first = (local_first != 0).to(tl.int32)
            part = (1 - step) + step * 2 * first
            active = (1 - step) * first + step * (pid < num_dispatch_programs).to(tl.int32)
            if active != 0:
                task = next_task(control_ptr, counter)
                while task < total:
                    dispatch_grad_task(
                        task, tasks_per_rank, rank_base, control_ptr, num_tokens_ptr,
                        x_ptr, g_ptr, x_rank_stride, scores_ptr, dest_rank_ptr, dest_slot_ptr, dest_tile_ptr,
                        route_rank_stride, arena_ptrs, act_anchor, i32_anchor, f32_anchor, anchor_rank,
                        off_tokens, off_slot_copy, off_slot_score, off_tile_arrivals,
                        token_capacity, slot_capacity, tile_capacity, silent_rank, part,
                        WORLD, DIM, TOP_K, BT, BD, KP,
                    )
                    task = next_task(control_ptr, counter)

    if do_tiles != 0:
        col_blocks = tl.cdiv(HIDDEN, BN)
        max_tiles = 0
        for local in range(NUM_LOCAL):
            max_tiles = tl.maximum(max_tiles, tl.load(num_tiles_ptr + local))
        total = NUM_LOCAL * max_tiles * col_blocks
        task = next_task(control_ptr, _CTL_BWD_DH)
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
                    weights = local.to(tl.int64) * weight_rank_stride + expert.to(tl.int64) * HIDDEN * DIM
                    hidden_at = local.to(tl.int64) * h_rank_stride
                    grad_hidden_tile(
                        arena_ptr(act_anchor, arena_ptrs, anchor_rank, rank, off_tokens),
                        arena_ptr(i32_anchor, arena_ptrs, anchor_rank, rank, off_slot_copy),
                        arena_ptr(f32_anchor, arena_ptrs, anchor_rank, rank, off_slot_score),
                        w1_ptr + weights, w2_ptr + weights, w3_ptr + weights,
                        h_ptr + hidden_at, dh1_ptr + hidden_at, dh3_ptr + hidden_at,
                        ds_parts_ptr + local.to(tl.int64) * ds_parts_rank_stride,
                        h13_ptr + local.to(tl.int64) * h13_rank_stride, g32_ptr + hidden_at,
                        m0, m1, col_block, DIM, HIDDEN, TOP_K, SCORE_BEFORE, BM, BN, BK, TWO_PASS, SAVED_H13,
                        PRECISION,
                    )
                    if COPY_ROWS:
                        # The weight gradients' dense slot rows (what gather_slot_rows_kernel
                        # writes otherwise): column chunk ``col_block`` of the tile's rows, so
                        # the copy overlaps the other programs' GEMM work.
                        NHB: tl.constexpr = (HIDDEN + BN - 1) // BN
                        CHUNK: tl.constexpr = ((DIM + NHB - 1) // NHB + BDC - 1) // BDC * BDC
                        capacity = local.to(tl.int64) * 0 + slot_capacity  # int64: S * D may pass 2**31
                        xs = slot_rows_ptr + local.to(tl.int64) * slot_rows_rank_stride
                        offs_s = m0 + tl.arange(0, BM)
                        d_lo = col_block * CHUNK
                        copy_slot_rows(
                            arena_ptr(act_anchor, arena_ptrs, anchor_rank, rank, off_tokens),
                            arena_ptr(i32_anchor, arena_ptrs, anchor_rank, rank, off_slot_copy),
                            arena_ptr(f32_anchor, arena_ptrs, anchor_rank, rank, off_slot_score),
                            xs, xs + capacity * DIM, offs_s, offs_s < m1, d_lo, tl.minimum(d_lo + CHUNK, DIM),
                            DIM, TOP_K, SCORE_BEFORE, BDC,
                        )
            task = next_task(control_ptr, _CTL_BWD_DH)


@triton.jit(do_not_specialize=["anchor_rank", "rank_base"])
def swiglu_backward_kernel(
    g32_ptr,  # (L, S, H) fp32: G = dOut @ w2 per slot (dH tiles with SAVED_H13)
    h13_ptr,  # (L, S, 2H) h1 | h3 saved by the forward
    h13_rank_stride,
    h_ptr,  # (L, S, H) out
    dh1_ptr,  # (L, S, H) out
    dh3_ptr,  # (L, S, H) out
    h_rank_stride,
    ds_parts_ptr,  # (L, S, NHB) fp32 out (scores after the experts)
    ds_parts_rank_stride,
    tables_ptr,  # (L, ROUTE_TABLE_ROWS, E) int32
    arena_ptrs,
    f32_anchor,
    anchor_rank,
    off_slot_score,
    rank_base,
    HIDDEN: tl.constexpr,
    NUM_EXPERTS_LOCAL: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    SCORE_BEFORE: tl.constexpr,
    BS: tl.constexpr,
    BN: tl.constexpr,
):
    """The dH tiles' SwiGLU backward as a streaming pass (saved h1 | h3):
    slots ``[pid0 * BS, + BS)`` below the rank's used rows x column block
    ``pid1`` of ``BN`` (the dH tile width: the same score-partial blocks) of
    local rank ``pid2``; the same arithmetic as the tile epilogue."""
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
        score = tl.load(arena_ptr(f32_anchor, arena_ptrs, anchor_rank, rank, off_slot_score) + offs_m, mask=mask_m,
                        other=0.0, cache_modifier=".cg")
        _swiglu_grad(acc_dh, gate_lp, up_lp, score, offs_m, mask_m, offs_n, mask_n, h_ptr + hidden_at,
                     dh1_ptr + hidden_at, dh3_ptr + hidden_at,
                     ds_parts_ptr + local.to(tl.int64) * ds_parts_rank_stride, col_block, HIDDEN, NHB, SCORE_BEFORE)


@triton.jit
def grad_input_tile(
    dh1, dh3, w1, w3, ds_parts, slot_copy, m0, m1, n0,
    arena_ptrs, act_anchor, i32_anchor, f32_anchor, anchor_rank, off_returned, off_returned_f32,
    off_token_arrivals, token_capacity, d1_desc, d3_desc, w1_desc, w3_desc, a_row, b_row,
    pending_source, pending_token, pending,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, SCORE_BEFORE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NHB: tl.constexpr, NHBP: tl.constexpr,
    RET_ROW_F32: tl.constexpr, PARTS_AT_F32: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    DEFER_RELEASE: tl.constexpr,
):
    """dA of slots ``m0..m1``, columns ``n0..n0+BN`` of D (one K-loop over H:
    ``dA = dh1 @ w1 + dh3 @ w3``), stored at each row's source; scores after
    the experts, the column-block-0 tile also sends each row's router-score
    gradient (its ``NHB`` partials summed in fp32). Returns (source rank,
    token, mask) of the rows, whose arrivals the caller releases
    (``fc2_combine.release_or_defer``); ``DEFER_RELEASE``: the previous
    tile's pending arrivals are released here, after the K-loop and before
    this tile's stores (a release after them would wait for them too).
    ``TMA``: the operands come through the tensor descriptors (``H`` a
    multiple of ``BK``)."""
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
    if DEFER_RELEASE:
        release_token_arrivals(pending_source, pending_token, pending, arena_ptrs, i32_anchor, anchor_rank,
                               off_token_arrivals)
    copy_id = tl.load(slot_copy + offs_m, mask=mask_m, other=0, cache_modifier=".cg")
    per_rank = token_capacity * TOP_K
    source = copy_id // per_rank
    row = (copy_id % per_rank).to(tl.int64)
    mask = mask_m[:, None] & mask_n[None, :]
    returned = arena_ptr(act_anchor, arena_ptrs, anchor_rank, source, off_returned)
    tl.store(returned[:, None] + row[:, None] * (2 * DIM) + offs_n[None, :], acc.to(dh1.dtype.element_ty),
             mask=mask)
    if not SCORE_BEFORE:
        if n0 == 0:
            offs_p = tl.arange(0, NHBP)
            parts = tl.load(ds_parts + offs_m[:, None].to(tl.int64) * NHB + offs_p[None, :],
                            mask=mask_m[:, None] & (offs_p < NHB)[None, :], other=0.0)
            total = tl.sum(parts, axis=1)
            ds = arena_ptr(f32_anchor, arena_ptrs, anchor_rank, source, off_returned_f32)
            tl.store(ds + row * RET_ROW_F32 + PARTS_AT_F32, total, mask=mask_m)
    # Every thread's row stores before any arrival is released (by the caller).
    tl.debug_barrier()
    return source, row // TOP_K, mask_m


@triton.jit
def reduce_grad_task(
    task, tasks_per_rank, rank_base, control_ptr, num_tokens_ptr, scores_ptr, route_rank_stride,
    x_ptr, x_rank_stride, dx_ptr, ds_ptr, arena_ptrs, act_anchor, i32_anchor, f32_anchor, anchor_rank,
    off_returned, off_returned_f32, off_token_arrivals, arrivals_per_token, timeout,
    DIM: tl.constexpr, TOP_K: tl.constexpr, SCORE_BEFORE: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr,
    KP: tl.constexpr, RET_ROW_F32: tl.constexpr, PARTS_AT_F32: tl.constexpr, USE_TIMER: tl.constexpr,
):
    """dx and ds of ``BT`` tokens, once all their dA rows are back."""
    local = task // tasks_per_rank
    rank = rank_base + local
    control = control_ptr + local * _CONTROL_WORDS
    num_tokens = tl.load(num_tokens_ptr + local)
    if has_failed(control) == 0:
        offs_t = (task % tasks_per_rank) * BT + tl.arange(0, BT)
        mask_t = offs_t < num_tokens
        arrivals = arena_ptr(i32_anchor, arena_ptrs, anchor_rank, rank, off_token_arrivals) + offs_t
        seen = wait_counters_at_least(arrivals, mask_t, arrivals_per_token, timeout, USE_TIMER)
        short = mask_t & (seen < arrivals_per_token)
        if tl.max(short.to(tl.int32)) > 0:
            first = tl.min(tl.where(short, offs_t, 1 << 30))
            record_failure(control, rank, task, _WAIT_TOKEN_ROWS, first, arrivals_per_token,
                           tl.min(tl.where(short, seen, 1 << 30)))
        else:
            returned = arena_ptr(act_anchor, arena_ptrs, anchor_rank, rank, off_returned)
            rows = offs_t.to(tl.int64) * TOP_K
            offs_k = tl.arange(0, KP)
            mask_tk = mask_t[:, None] & (offs_k < TOP_K)[None, :]
            route = local * route_rank_stride + offs_t[:, None] * TOP_K + offs_k[None, :]
            ds = tl.zeros((BT, KP), dtype=tl.float32)
            tok = local.to(tl.int64) * x_rank_stride + offs_t[:, None].to(tl.int64) * DIM
            for d0 in range(0, DIM, BD):
                offs_d = d0 + tl.arange(0, BD)
                mask = mask_t[:, None] & (offs_d < DIM)[None, :]
                acc = tl.zeros((BT, BD), dtype=tl.float32)
                if SCORE_BEFORE:
                    x = tl.load(x_ptr + tok + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
                for k in range(0, TOP_K):
                    da = tl.load(returned + (rows + k)[:, None] * (2 * DIM) + offs_d[None, :], mask=mask,
                                 other=0.0, cache_modifier=".cg").to(tl.float32)
                    if SCORE_BEFORE:
                        score = tl.load(scores_ptr + local * route_rank_stride + offs_t * TOP_K + k, mask=mask_t)
                        acc += score[:, None] * da
                        part = tl.sum(x * da, axis=1)
                        ds += tl.where(offs_k[None, :] == k, part[:, None], 0.0)
                    else:
                        acc += da
                tl.store(dx_ptr + tok + offs_d[None, :], acc.to(dx_ptr.dtype.element_ty), mask=mask)
            if not SCORE_BEFORE:
                returned_f32 = arena_ptr(f32_anchor, arena_ptrs, anchor_rank, rank, off_returned_f32)
                at = (rows[:, None] + offs_k[None, :]) * RET_ROW_F32 + PARTS_AT_F32
                ds = tl.load(returned_f32 + at, mask=mask_tk, other=0.0, cache_modifier=".cg")
            tl.store(ds_ptr + route, ds, mask=mask_tk)


@triton.jit(do_not_specialize=["anchor_rank", "rank_base", "do_tiles", "do_reduce", "timeout", "dh_rows", "w_rows"])
def grad_input_combine_kernel(
    dh1_ptr,  # (L, S, H)
    dh3_ptr,  # (L, S, H)
    h_rank_stride,
    w1_ptr,  # (L, El, H, D)
    w3_ptr,  # (L, El, H, D)
    weight_rank_stride,
    tile_expert_ptr,  # (L, C) int32
    tile_start_ptr,
    tile_end_ptr,
    tile_rank_stride,
    num_tiles_ptr,  # (L,) int32
    ds_parts_ptr,  # (L, S, NHB) fp32 (scores after the experts)
    ds_parts_rank_stride,
    scores_ptr,  # (L, T, K) fp32
    route_rank_stride,
    num_tokens_ptr,  # (L,) int32
    x_ptr,  # (L, T, D)
    x_rank_stride,
    dx_ptr,  # (L, T, D) out
    ds_ptr,  # (L, T, K) fp32 out
    control_ptr,  # (L, CONTROL_WORDS) int64
    arena_ptrs,
    act_anchor,
    i32_anchor,
    f32_anchor,
    anchor_rank,
    off_slot_copy,
    off_returned,
    off_returned_f32,  # fp32 element offset of ``returned``
    off_token_arrivals,
    rank_base,
    token_capacity,
    slot_capacity,
    do_tiles,
    do_reduce,
    timeout,
    dh_rows,  # rows of dh1 / dh3 as (rows, H) and of w1 / w3 as (rows, D) matrices (TMA)
    w_rows,
    NUM_LOCAL: tl.constexpr,
    DIM: tl.constexpr,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    SCORE_BEFORE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    NHB: tl.constexpr,  # column blocks of the dH tiles (score partials per slot)
    NHBP: tl.constexpr,  # next power of two >= NHB
    GROUP_M: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    KP: tl.constexpr,
    RET_ROW_F32: tl.constexpr,
    PARTS_AT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TIMER: tl.constexpr,
    DEFER_RELEASE: tl.constexpr = False,
    TMA: tl.constexpr = False,
):
    col_blocks = tl.cdiv(DIM, BN)
    d1_desc = matrix_descriptor(dh1_ptr, dh_rows, HIDDEN, BM, BK, TMA)
    d3_desc = matrix_descriptor(dh3_ptr, dh_rows, HIDDEN, BM, BK, TMA)
    w1_desc = matrix_descriptor(w1_ptr, w_rows, DIM, BK, BN, TMA)
    w3_desc = matrix_descriptor(w3_ptr, w_rows, DIM, BK, BN, TMA)
    # DEFER_RELEASE: a tile's arrivals are released after the program's next
    # tile (as megakernel B's ``defer_release``); the last ones after the loop.
    pending_source = tl.zeros([BM], dtype=tl.int32)
    pending_token = tl.zeros([BM], dtype=tl.int64)
    pending = tl.zeros([BM], dtype=tl.int1)
    if do_tiles != 0:
        max_tiles = 0
        for local in range(NUM_LOCAL):
            max_tiles = tl.maximum(max_tiles, tl.load(num_tiles_ptr + local))
        total = NUM_LOCAL * max_tiles * col_blocks
        task = next_task(control_ptr, _CTL_BWD_DA)
        while task < total:
            local = task % NUM_LOCAL
            rank = rank_base + local
            control = control_ptr + local * _CONTROL_WORDS
            num_tiles = tl.load(num_tiles_ptr + local)
            rank_task = task // NUM_LOCAL
            if (rank_task < num_tiles * col_blocks) & (has_failed(control) == 0):
                tile, col_block = grouped_tile_task(rank_task, num_tiles, col_blocks, GROUP_M)
                expert = tl.load(tile_expert_ptr + local * tile_rank_stride + tile)
                m0 = tl.load(tile_start_ptr + local * tile_rank_stride + tile)
                m1 = tl.load(tile_end_ptr + local * tile_rank_stride + tile)
                if m1 <= slot_capacity:
                    weights = local.to(tl.int64) * weight_rank_stride + expert.to(tl.int64) * HIDDEN * DIM
                    hidden_at = local.to(tl.int64) * h_rank_stride
                    source, token, rows = grad_input_tile(
                        dh1_ptr + hidden_at, dh3_ptr + hidden_at, w1_ptr + weights, w3_ptr + weights,
                        ds_parts_ptr + local.to(tl.int64) * ds_parts_rank_stride,
                        arena_ptr(i32_anchor, arena_ptrs, anchor_rank, rank, off_slot_copy),
                        m0, m1, col_block * BN, arena_ptrs, act_anchor, i32_anchor, f32_anchor, anchor_rank,
                        off_returned, off_returned_f32, off_token_arrivals, token_capacity,
                        d1_desc, d3_desc, w1_desc, w3_desc,
                        local * (h_rank_stride // HIDDEN).to(tl.int32) + m0,
                        local * (weight_rank_stride // DIM).to(tl.int32) + expert * HIDDEN,
                        pending_source, pending_token, pending,
                        DIM, HIDDEN, TOP_K, SCORE_BEFORE, BM, BN, BK, NHB, NHBP,
                        RET_ROW_F32, PARTS_AT_F32, PRECISION, TMA, DEFER_RELEASE,
                    )
                    pending_source, pending_token, pending = release_or_defer(
                        source, token, rows, pending_source, pending_token, pending, arena_ptrs, i32_anchor,
                        anchor_rank, off_token_arrivals, DEFER_RELEASE)
            task = next_task(control_ptr, _CTL_BWD_DA)
        if DEFER_RELEASE:
            release_token_arrivals(pending_source, pending_token, pending, arena_ptrs, i32_anchor, anchor_rank,
                                   off_token_arrivals)

    if do_reduce != 0:
        max_tokens = 0
        for local in range(NUM_LOCAL):
            max_tokens = tl.maximum(max_tokens, tl.load(num_tokens_ptr + local))
        tasks_per_rank = tl.cdiv(max_tokens, BT)
        total = NUM_LOCAL * tasks_per_rank
        task = next_task(control_ptr, _CTL_BWD_REDUCE)
        while task < total:
            reduce_grad_task(
                task, tasks_per_rank, rank_base, control_ptr, num_tokens_ptr, scores_ptr, route_rank_stride,
                x_ptr, x_rank_stride, dx_ptr, ds_ptr, arena_ptrs, act_anchor, i32_anchor, f32_anchor, anchor_rank,
                off_returned, off_returned_f32, off_token_arrivals, TOP_K * col_blocks, timeout,
                DIM, TOP_K, SCORE_BEFORE, BT, BD, KP, RET_ROW_F32, PARTS_AT_F32, USE_TIMER,
            )
            task = next_task(control_ptr, _CTL_BWD_REDUCE)
