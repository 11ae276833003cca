"""dispatch_fc1 (forward megakernel A): dispatch + grouped GEMM fc1 (w1, w3) + SwiGLU.

Index arrays (``L`` local ranks: 1 for real EP, ``W`` for the simulated
world, where every per-rank array is stacked on a leading rank dimension):

- ``route`` (``scoreboard.Route``): source side ``(L, T_cap, K)``
  ``dest_rank``/``dest_slot``/``dest_tile`` int32 (``layout.compute_layout`` /
  ``compute_tiles``, written on the device by ``kernels.route``); receive side
  ``(L, C)`` int32 ``tile_expert``, ``tile_start``, ``tile_end``,
  ``tile_order`` and ``num_tiles`` ``(L,)``;
- ``scores`` ``(L, T_cap, K)`` fp32;
- in every rank's arena (``scoreboard.Arena``): ``tokens`` ``(W * T_cap, D)``,
  the de-duplicated token rows (source ``s``'s token ``t`` at row
  ``s * T_cap + t``, ``layout.token_row``; empty with one rank, where the
  tiles read x in place); ``slot_copy`` ``(S,) int32``, for
  each receive slot the copy id ``(s * T_cap + t) * K + k`` it holds (its
  token row is ``copy // K``); ``slot_score`` ``(S,) fp32``;
  ``tile_arrivals`` ``(C,) int32``, slots of each tile that have arrived.

Tasks, claimed from atomic counters by a persistent grid:

1. Dispatch (``scoreboard.dispatch_tasks``, ``dispatch_block_tokens`` tokens
   of one source rank): copy each token's row once to every rank that owns
   one of its experts, write its copies' slot entries there, then release one
   arrival per copy on the copy's tile. Run by the first ``dispatch_programs``
   programs (with ``local_first``, every program first copies the rows that
   stay on its rank).
2. fc1 (tile of one local expert x ``fc1_block_n`` columns of h): wait
   (acquire, bounded) until all the tile's slots arrived
   (``tile_arrivals[tile] == rows``), gather their token rows (with one rank,
   from x itself: ``scoreboard.token_rows_of``), scale them by
   the router score when scores come before the experts (TorchTitan:
   ``(x.float() * score).to(x.dtype)``), compute
   ``h = silu(x @ w1^T) * (x @ w3^T)`` with TorchTitan's rounding steps, and
   store h at the tile's slots (and, ``SAVE_H13``, h1 | h3 for the backward).

Sequential schedule: the same kernel launched twice (dispatch tasks only,
then fc1 tasks only). Both schedules run the same compiled tile code on the
same slots, so h is bitwise identical; only *when* a tile runs differs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .scoreboard import (
    CTL_TILE_TASKS,
    arena_ptr,
    claim_task,
    dispatch_tasks,
    gemm_tile_task,
    max_over_ranks,
    token_rows_of,
)

_CTL_TILE_TASKS = tl.constexpr(CTL_TILE_TASKS)


def fc1_launch_stages(num_stages: int, score_before: bool) -> int:
    """The software-pipelining depth ``dispatch_fc1_kernel`` is launched with
    for ``LayerParams.fc1_num_stages = num_stages``: that, or 1 (no
    pipelining) with scores before the experts.

    There the fc1 tile scales its gathered rows by the router score in
    registers, so Triton 3.6 feeds them to wgmma from registers, and
    pipelined (2 stages or more) it keeps wgmma groups in flight across K
    steps; that loop raced on an H200 (evidence: ``docs/design.md``, "Scores
    before the experts: fc1 unpipelined"). Unpipelined, every wgmma
    completes before the next K step loads (no group pending, which
    ``tests/test_kernels_compile.py`` checks). The products and their order
    are unchanged, so are the bits."""
    return 1 if score_before else num_stages


@triton.jit
def fc1_tile(
    x_rows, slot_copy, slot_score, w1, w3, h, h13, m0, m1, n0,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, SCORE_BEFORE: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr, SAVE_H13: tl.constexpr, ONE_DOT: tl.constexpr,
):
    """h[m0:m1, n0:n0+BN] of one expert from the slots' token rows (``x_rows``:
    ``scoreboard.token_rows_of``); ``w1``/``w3`` point at its (H, D) weights. ``SAVE_H13``: also h1 and h3 (rounded) into ``h13`` ``(S, 2H)``
    rows, for the backward. ``ONE_DOT`` (``LayerParams.fc1_one_dot``): one
    ``BM x 2BN`` product per K step over interleaved w1 | w3 columns instead
    of two ``BM x BN`` ones; every output element sums the same products in
    the same K order either way."""
    offs_m = m0 + tl.arange(0, BM)
    mask_m = offs_m < m1
    offs_n = n0 + tl.arange(0, BN)
    mask_n = offs_n < HIDDEN
    offs_k = tl.arange(0, BK)
    copy_id = tl.load(slot_copy + offs_m, mask=mask_m, other=0, cache_modifier=".cg")
    token_row = (copy_id // TOP_K).to(tl.int64)
    a_ptrs = x_rows + token_row[:, None] * DIM + offs_k[None, :]
    score = mask_m  # unused unless SCORE_BEFORE
    if SCORE_BEFORE:
        score = tl.load(slot_score + offs_m, mask=mask_m, other=0.0, cache_modifier=".cg")
    if ONE_DOT:
        gate, up = _fc1_one_dot(a_ptrs, mask_m, w1, w3, n0, score, DIM, HIDDEN, SCORE_BEFORE, BM, BN, BK, EVEN_K,
                                EVEN_N, PRECISION)
    else:
        gate, up = _fc1_two_dots(a_ptrs, mask_m, w1, w3, n0, score, DIM, HIDDEN, SCORE_BEFORE, BM, BN, BK, EVEN_K,
                                 EVEN_N, PRECISION)
    # TorchTitan: h = silu(grouped_mm(x, w1)) * grouped_mm(x, w3), each result
    # rounded to the activation dtype; torch's silu is x / (1 + exp(-x)) in fp32.
    out_ty = h.dtype.element_ty
    gate = gate.to(out_ty)
    up = up.to(out_ty)
    gate_f = gate.to(tl.float32)
    act = (gate_f / (1.0 + tl.exp(-gate_f))).to(out_ty).to(tl.float32)
    tl.store(
        h + offs_m[:, None].to(tl.int64) * HIDDEN + offs_n[None, :],
        (act * up.to(tl.float32)).to(out_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )
    if SAVE_H13:
        saved = h13 + offs_m[:, None].to(tl.int64) * (2 * HIDDEN) + offs_n[None, :]
        tl.store(saved, gate, mask=mask_m[:, None] & mask_n[None, :])
        tl.store(saved + HIDDEN, up, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _fc1_a(a_ptrs, mask_m, k, score, DIM: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
           SCORE_BEFORE: tl.constexpr):
    """K step ``k`` of an fc1 tile's gathered token rows (scaled by the router
    score first when scores come before the experts)."""
    if EVEN_K:
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0, cache_modifier=".cg")
    else:
        mask_k = tl.arange(0, BK) < DIM - k * BK
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0, cache_modifier=".cg")
    if SCORE_BEFORE:
        a = (a.to(tl.float32) * score[:, None]).to(a.dtype)
    return a


@triton.jit
def _fc1_b(b_ptrs, mask_cols, k, DIM: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """K step ``k`` of a ``(BK, columns)`` weight tile (columns past H masked)."""
    if EVEN_K:
        if EVEN_N:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=mask_cols[None, :], other=0.0)
    else:
        mask_k = tl.arange(0, BK) < DIM - k * BK
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_cols[None, :], other=0.0)
    return b


@triton.jit
def _fc1_two_dots(a_ptrs, mask_m, w1, w3, n0, score, DIM: tl.constexpr, HIDDEN: tl.constexpr,
                  SCORE_BEFORE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 ``x @ w1^T`` and ``x @ w3^T`` of the tile, one accumulator each."""
    offs_n = n0 + tl.arange(0, BN)
    mask_n = offs_n < HIDDEN
    rows = offs_n[None, :].to(tl.int64) * DIM + tl.arange(0, BK)[:, None]
    b1_ptrs = w1 + rows
    b3_ptrs = w3 + rows
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(DIM, BK)):
        a = _fc1_a(a_ptrs, mask_m, k, score, DIM, BK, EVEN_K, SCORE_BEFORE)
        acc1 = tl.dot(a, _fc1_b(b1_ptrs, mask_n, k, DIM, BK, EVEN_K, EVEN_N), acc1, input_precision=PRECISION)
        acc3 = tl.dot(a, _fc1_b(b3_ptrs, mask_n, k, DIM, BK, EVEN_K, EVEN_N), acc3, input_precision=PRECISION)
        a_ptrs += BK
        b1_ptrs += BK
        b3_ptrs += BK
    return acc1, acc3


@triton.jit
def _fc1_one_dot(a_ptrs, mask_m, w1, w3, n0, score, DIM: tl.constexpr, HIDDEN: tl.constexpr,
                 SCORE_BEFORE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr):
    """``_fc1_two_dots``' products from one ``BM x 2BN`` accumulator: column
    ``2j`` is h1's column ``n0 + j`` (a w1 row), ``2j + 1`` h3's (a w3 row).
    One wide MMA chain reads each A tile from shared memory once per K step
    instead of twice; interleaving keeps each (h1, h3) pair in one thread, so
    splitting the accumulator moves no data."""
    offs_j = tl.arange(0, 2 * BN)
    col = n0 + offs_j // 2
    rows = col[None, :].to(tl.int64) * DIM + tl.arange(0, BK)[:, None]
    b_ptrs = tl.where((offs_j % 2 == 1)[None, :], w3 + rows, w1 + rows)
    acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(DIM, BK)):
        a = _fc1_a(a_ptrs, mask_m, k, score, DIM, BK, EVEN_K, SCORE_BEFORE)
        acc = tl.dot(a, _fc1_b(b_ptrs, col < HIDDEN, k, DIM, BK, EVEN_K, EVEN_N), acc, input_precision=PRECISION)
        a_ptrs += BK
        b_ptrs += BK
    return tl.split(tl.reshape(acc, (BM, BN, 2)))


# Runtime scalars that differ between launches of one call (schedule phases,
# ranks) are not specialised: both schedules then run one compiled binary.
@triton.jit(do_not_specialize=["anchor_rank", "rank_base", "do_dispatch", "do_fc1", "num_dispatch_programs",
                               "silent_rank", "timeout", "local_first"])
def dispatch_fc1_kernel(
    x_ptr,  # (L, T, D) activations
    x_rank_stride,
    scores_ptr,  # (L, T_cap, K) fp32 router scores
    route,  # scoreboard.Route
    w1_ptr,  # (L, El, H, D)
    w3_ptr,  # (L, El, H, D)
    weight_rank_stride,
    h_ptr,  # (L, S, H) out, expert-major slots
    h_rank_stride,
    h13_ptr,  # (L, S, 2H) out when SAVE_H13: h1 | h3 per slot (any pointer otherwise)
    h13_rank_stride,
    control_ptr,  # (L, CONTROL_WORDS) int64
    arena,  # scoreboard.Arena
    anchor_rank,
    rank_base,
    do_dispatch,
    do_fc1,
    num_dispatch_programs,
    silent_rank,  # LayerParams.debug_silent_rank
    timeout,
    local_first,  # LayerParams.local_first
    NUM_LOCAL: tl.constexpr, WORLD: tl.constexpr, DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
    KP: tl.constexpr,  # next power of two >= TOP_K
    SCORE_BEFORE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr, USE_TIMER: tl.constexpr,
    SAVE_H13: tl.constexpr = False,
    ONE_DOT: tl.constexpr = False,  # LayerParams.fc1_one_dot
    RACE: tl.constexpr = False,  # LayerParams.debug_race (testing only; scoreboard: race mode)
    SLACK: tl.constexpr = 0,  # LayerParams.debug_wait_slack (testing only)
    SCOPE: tl.constexpr = "sys",  # scoreboard.sync_scope
):
    EVEN_K: tl.constexpr = DIM % BK == 0
    EVEN_N: tl.constexpr = HIDDEN % BN == 0
    if do_dispatch != 0:
        dispatch_tasks(control_ptr, x_ptr, x_ptr, x_rank_stride, scores_ptr, route, arena, anchor_rank, rank_base,
                       silent_rank, num_dispatch_programs, local_first, NUM_LOCAL, WORLD, DIM, TOP_K, BT, BD, KP, 1,
                       USE_TIMER, RACE, SCOPE)

    if do_fc1 != 0:
        col_blocks = tl.cdiv(HIDDEN, BN)
        total = NUM_LOCAL * max_over_ranks(route.num_tiles, NUM_LOCAL) * col_blocks
        task = claim_task(control_ptr, _CTL_TILE_TASKS)
        while task < total:
            ready, local, rank, tile, col_block, expert, m0, m1 = gemm_tile_task(
                task, route, arena, anchor_rank, rank_base, control_ptr, col_blocks, local_first, timeout,
                NUM_LOCAL, GROUP_M, True, USE_TIMER, WORLD, BM, RACE, SLACK, SCOPE)
            if ready:
                expert_offset = local.to(tl.int64) * weight_rank_stride + expert.to(tl.int64) * HIDDEN * DIM
                x_rows, _ = token_rows_of(arena, anchor_rank, rank, local, x_ptr, x_ptr, x_rank_stride, WORLD, DIM)
                fc1_tile(
                    x_rows,
                    arena_ptr(arena.i32, arena, anchor_rank, rank, arena.slot_copy),
                    arena_ptr(arena.f32, arena, anchor_rank, rank, arena.slot_score),
                    w1_ptr + expert_offset,
                    w3_ptr + expert_offset,
                    h_ptr + local.to(tl.int64) * h_rank_stride,
                    h13_ptr + local.to(tl.int64) * h13_rank_stride,
                    m0, m1, col_block * BN, DIM, HIDDEN, TOP_K,
                    SCORE_BEFORE, BM, BN, BK, EVEN_K, EVEN_N, PRECISION, SAVE_H13, ONE_DOT,
                )
            task = claim_task(control_ptr, _CTL_TILE_TASKS)
