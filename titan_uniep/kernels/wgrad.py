"""wgrad: the expert weight gradients of the backward, outside the communication megakernels.

They need no cross-rank traffic once dispatch_dh has run (the ``[x | dOut]``
rows have arrived and ``dh1``/``dh3``/``h`` are stored per slot), so they run
as their own launches with their own tiles, identically in both schedules
(bitwise equal weight gradients):

1. ``gather_slot_rows_kernel``: each used slot's x row (times the slot's score,
   rounded, when scores come before the experts: the forward's fc1 operand)
   and dOut row, copied from the de-duplicated token rows (x and dOut in
   place with one rank) into dense
   ``(S, D)`` arrays in slot order, so an expert's rows are one contiguous
   range ``[lo_e, lo_e + rows_e)`` of every operand.
2. Per expert, ``dW1 = dh1^T xs``, ``dW3 = dh3^T xs`` ``(H, D)`` and
   ``dW2 = dys^T h`` ``(D, H)``: on the GPU in bf16 by ``torch._grouped_mm``
   (groups along the rows, TorchTitan's own weight-gradient GEMM; each output
   tile reduces over all of its expert's rows in one pass, no split-K, no
   atomics), elsewhere by ``wgrad_kernel`` below.

``wgrad_kernel``: one program per ``BM x BN`` output block of one
expert, looping over ALL the expert's rows in slot order, ``BK`` rows a step,
in fp32. With ``TMA`` the operands are read through tensor descriptors made
on the device over the expert's own rows (the copy engine zero-fills rows
past the expert); otherwise by masked pointer loads. Same sums, same order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .route import local_expert_rows, used_slots
from .scoreboard import arena_ptr, token_rows_of


@triton.jit
def copy_slot_rows(x_rows, dy_rows, slot_copy, slot_score, xs, dys, offs_s, mask_s, d_lo, d_hi, DIM: tl.constexpr,
                   TOP_K: tl.constexpr, ROW: tl.constexpr, SCORE_BEFORE: tl.constexpr, BD: tl.constexpr):
    """Columns ``[d_lo, d_hi)`` of slots ``offs_s``' x rows (times the slot's
    score, rounded, when scores come before the experts: the forward's fc1
    operand) and dOut rows, from the token rows (``scoreboard.token_rows_of``:
    the de-duplicated ``[x | dOut]`` rows, or x and dOut in place; ``ROW``
    elements apart) into ``xs``/``dys`` ``(S, D)`` in slot order. Used by the
    gather kernel below and by dispatch_dh's dH tasks
    (``LayerParams.dh_copies_rows``)."""
    copy = tl.load(slot_copy + offs_s, mask=mask_s, other=0, cache_modifier=".cg")
    token = (copy // TOP_K).to(tl.int64)[:, None] * ROW
    rows = x_rows + token
    g_rows = dy_rows + token
    if SCORE_BEFORE:
        score = tl.load(slot_score + offs_s, mask=mask_s, other=0.0, cache_modifier=".cg")
    at = offs_s.to(tl.int64)[:, None] * DIM
    d0 = d_lo
    while d0 < d_hi:  # (not a range: the interpreter cannot run one with loaded bounds)
        offs_d = d0 + tl.arange(0, BD)
        mask = mask_s[:, None] & (offs_d < d_hi)[None, :]
        x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        if SCORE_BEFORE:
            x = (x.to(tl.float32) * score[:, None]).to(x.dtype)
        tl.store(xs + at + offs_d[None, :], x, mask=mask)
        g = tl.load(g_rows + offs_d[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(dys + at + offs_d[None, :], g, mask=mask)
        d0 += BD


@triton.jit(do_not_specialize=["anchor_rank", "rank_base"])
def gather_slot_rows_kernel(
    out_ptr,  # (L, 2, S, D): [xs, dys]
    tables_ptr,  # (L, ROUTE_TABLE_ROWS, E) int32
    x_ptr,  # (L, T, D) the forward's input (read in place with one rank)
    g_ptr,  # (L, T, D) the output gradient (likewise)
    x_rank_stride,
    arena,  # scoreboard.Arena (tokens: (W * T_cap, 2D) [x | dOut] token rows)
    anchor_rank,
    rank_base,
    WORLD: tl.constexpr,
    DIM: tl.constexpr,
    TOP_K: tl.constexpr,
    NUM_EXPERTS_LOCAL: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    SCORE_BEFORE: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
):
    """Slots ``[pid * BS, + BS)`` of local rank ``program_id(1)``; slots past the
    rank's used rows (its last local expert's end) are left as they are."""
    local = tl.program_id(1)
    rank = rank_base + local
    used = used_slots(tables_ptr, local, rank, NUM_EXPERTS_LOCAL, NUM_EXPERTS)
    s0 = tl.program_id(0) * BS
    if s0 < used:
        offs_s = s0 + tl.arange(0, BS)
        capacity = local.to(tl.int64) * 0 + arena.slot_capacity  # int64 from here: S * D may pass 2**31
        xs = out_ptr + local * 2 * capacity * DIM
        x_rows, dy_rows = token_rows_of(arena, anchor_rank, rank, local, x_ptr, g_ptr, x_rank_stride, WORLD, DIM)
        ROW: tl.constexpr = 2 * DIM if WORLD > 1 else DIM
        copy_slot_rows(
            x_rows, dy_rows,
            arena_ptr(arena.i32, arena, anchor_rank, rank, arena.slot_copy),
            arena_ptr(arena.f32, arena, anchor_rank, rank, arena.slot_score),
            xs, xs + capacity * DIM, offs_s, offs_s < used, 0, DIM, DIM, TOP_K, ROW, SCORE_BEFORE, BD,
        )


@triton.jit
def _rows_tile(ptr, desc, k, lo, rows, offs_k, offs_c, mask_c, stride, TMA: tl.constexpr):
    """Rows ``k .. k + BK`` of the expert (zeros past ``rows``) x the block's columns."""
    if TMA:
        tile = desc.load([k, 0])
    else:
        r = k + offs_k
        row = (lo + r).to(tl.int64)
        tile = tl.load(ptr + row[:, None] * stride + offs_c[None, :], mask=(r < rows)[:, None] & mask_c[None, :],
                       other=0.0)
    return tile


@triton.jit
def _step(acc1, acc2, k, lo, rows, a1, a2, da1, da2, a_stride, b, db, b_stride, offs_k, cols_m, mask_m, cols_n,
          mask_n, TWO_A: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr):
    bt = _rows_tile(b, db, k, lo, rows, offs_k, cols_n, mask_n, b_stride, TMA)
    at = _rows_tile(a1, da1, k, lo, rows, offs_k, cols_m, mask_m, a_stride, TMA)
    acc1 = tl.dot(tl.trans(at), bt, acc1, input_precision=PRECISION)
    if TWO_A:
        at2 = _rows_tile(a2, da2, k, lo, rows, offs_k, cols_m, mask_m, a_stride, TMA)
        acc2 = tl.dot(tl.trans(at2), bt, acc2, input_precision=PRECISION)
    return acc1, acc2


@triton.jit
def _descriptor(ptr, lo, rows, stride, col0, COLS: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
                ON: tl.constexpr):
    """A descriptor of the expert's rows ``[lo, lo + rows)`` x columns ``[col0, COLS)``."""
    if ON:
        desc = tl.make_tensor_descriptor(ptr + lo.to(tl.int64) * stride + col0,
                                         shape=[tl.maximum(rows, 1), COLS - col0], strides=[stride, 1],
                                         block_shape=[BK, BC])
    else:
        desc = ptr
    return desc


@triton.jit(do_not_specialize=["rank_base"])
def wgrad_kernel(
    a1_ptr,  # (L, S, M) first A operand
    a2_ptr,  # (L, S, M) second A operand (TWO_A)
    a_stride,  # row stride of A
    a_local_stride,  # elements between local ranks' A
    b_ptr,  # (L, S, N) B operand
    b_stride,
    b_local_stride,
    tables_ptr,  # (L, ROUTE_TABLE_ROWS, E) int32 route tables
    out1_ptr,  # (L, El, M, N)
    out2_ptr,  # (L, El, M, N) (TWO_A)
    rank_base,
    M: tl.constexpr,
    N: tl.constexpr,
    NUM_EXPERTS_LOCAL: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    TWO_A: tl.constexpr,
    TMA: tl.constexpr,
    STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """``out1[e] = A1_e^T B_e`` (and ``out2[e] = A2_e^T B_e``) for local rank
    ``program_id(1)``; experts without rows get zeros."""
    local = tl.program_id(1)
    pid = tl.program_id(0)
    num_m: tl.constexpr = (M + BM - 1) // BM
    num_n: tl.constexpr = (N + BN - 1) // BN
    expert = pid // (num_m * num_n)
    t = pid % (num_m * num_n)
    # Grouped order within an expert: GROUP M blocks sweep the N blocks together (L2 reuse of B).
    width = GROUP * num_n
    first_m = (t // width) * GROUP
    group_size = tl.minimum(num_m - first_m, GROUP)
    mb = first_m + (t % width) % group_size
    nb = (t % width) // group_size

    rank = rank_base + local
    lo, rows = local_expert_rows(tables_ptr, local, rank, expert, NUM_EXPERTS_LOCAL, NUM_EXPERTS)

    a1 = a1_ptr + local.to(tl.int64) * a_local_stride
    a2 = a2_ptr + local.to(tl.int64) * a_local_stride
    b = b_ptr + local.to(tl.int64) * b_local_stride
    offs_m = mb * BM + tl.arange(0, BM)
    offs_n = nb * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N
    da1 = _descriptor(a1, lo, rows, a_stride, mb * BM, M, BK, BM, TMA)
    da2 = _descriptor(a2, lo, rows, a_stride, mb * BM, M, BK, BM, TMA and TWO_A)
    db = _descriptor(b, lo, rows, b_stride, nb * BN, N, BK, BN, TMA)
    # Pointer loads address columns from the block's origin (descriptors carry it).
    a1 = a1 + mb * BM
    a2 = a2 + mb * BM
    b = b + nb * BN
    offs_k = tl.arange(0, BK)
    cols_m = tl.arange(0, BM)
    cols_n = tl.arange(0, BN)

    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    if INTERPRET:  # the interpreter cannot run a range with loaded bounds
        k = 0
        while k < rows:
            acc1, acc2 = _step(acc1, acc2, k, lo, rows, a1, a2, da1, da2, a_stride, b, db, b_stride, offs_k,
                               cols_m, mask_m, cols_n, mask_n, TWO_A, TMA, PRECISION)
            k += BK
    else:
        for k in tl.range(0, rows, BK, num_stages=STAGES):
            acc1, acc2 = _step(acc1, acc2, k, lo, rows, a1, a2, da1, da2, a_stride, b, db, b_stride, offs_k,
                               cols_m, mask_m, cols_n, mask_n, TWO_A, TMA, PRECISION)
    out = ((local.to(tl.int64) * NUM_EXPERTS_LOCAL + expert) * M * N + offs_m[:, None].to(tl.int64) * N
           + offs_n[None, :])
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(out1_ptr + out, acc1.to(out1_ptr.dtype.element_ty), mask=mask)
    if TWO_A:
        tl.store(out2_ptr + out, acc2.to(out2_ptr.dtype.element_ty), mask=mask)
