"""Scoreboard primitives shared by the megakernels, and the counts exchange.

Every cross-rank signal is a counter or flag in a rank's symmetric *arena*
(see ``titan_uniep.symm``): producers write data with plain stores, then
``tl.debug_barrier()`` (so every thread's stores are ordered before the
signal) and bump the counter with a ``release`` atomic at system scope;
consumers poll with ``acquire`` atomics at system scope and read the data
after a barrier. Data written by a peer is read with ``cache_modifier=".cg"``
(L2 only): the L1 is not coherent, and a neighbouring tile may already have
pulled the line in before the peer wrote it.

Every spin is bounded (``timeout``: microseconds of ``%globaltimer`` on the
GPU, polls under the interpreter; an int32 either way, so changing it never
recompiles a kernel). A wait that runs out writes the rank's *error record*
(first failure wins) and the task is skipped; every later task of that rank
sees the record and skips too, so a missing peer ends in one bounded wait per
program, never a hang. The host turns the record into a RuntimeError.

Control words, ``(L, CONTROL_WORDS) int64`` per local rank (ordinary device
memory, never written by a peer): task counters of each launch, the call
epoch, the error record.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from .route import ROUTE_TABLE_ROWS, scan_block_counts, write_route_tables

_ROUTE_TABLE_ROWS = tl.constexpr(ROUTE_TABLE_ROWS)

CONTROL_WORDS = 16
# Task counters: words 0-7 but the epoch (zeroed by the exchange at the start of every call).
CTL_DISPATCH_TASKS = 0
CTL_FC1_TASKS = 1
CTL_FC2_TASKS = 2
CTL_REDUCE_TASKS = 3
CTL_SEND_TASKS = 4
CTL_EPOCH = 5
CTL_OWN_DISPATCH_TASKS = 6  # dispatch of rows to this rank itself (KernelConfig.local_first)
# Error record: flag, rank, task, what, index, expected, seen, epoch.
CTL_ERROR = 8
TASK_COUNTER_WORDS = tuple(w for w in range(CTL_ERROR) if w != CTL_EPOCH)
ERROR_FIELDS = ("flag", "rank", "task", "what", "index", "expected", "seen", "epoch")

# What a failed wait was waiting for (the record's ``what``).
WAIT_COUNTS_FLAG = 1  # index: source rank whose counts never arrived
WAIT_TILE_ROWS = 2  # index: fc1 tile whose rows never all arrived
WAIT_TOKEN_ROWS = 3  # index: token whose K expert rows never all came back
BAD_SLOT = 4  # index: token whose copy's slot/tile is outside the receive buffer
WAIT_TILE_DONE = 5  # index: fc2 tile whose output a combine-send task waited for (staged combine)

_CTL_EPOCH = tl.constexpr(CTL_EPOCH)
_CTL_ERROR = tl.constexpr(CTL_ERROR)
_CONTROL_WORDS = tl.constexpr(CONTROL_WORDS)
_WAIT_COUNTS_FLAG = tl.constexpr(WAIT_COUNTS_FLAG)


@triton.jit
def arena_ptr(anchor, arena_ptrs, anchor_rank, rank, offset):
    """Typed pointer to element ``offset`` of ``rank``'s arena (``rank`` may be
    a block: one pointer per element).

    ``anchor`` is a typed kernel argument pointing at the arena of
    ``anchor_rank``; other arenas are reached as ``anchor + delta`` (one
    address space for all peers, UVA). Deliberately not an int-to-pointer cast:
    that loses the compiler's alignment knowledge, and then the gathered GEMM
    rows are neither vectorised nor pipelined and every row copy to a peer is
    split into 2-byte stores. Arenas are 256-byte aligned, which the rounding
    tells the alignment analysis.
    """
    elem: tl.constexpr = anchor.dtype.element_ty.primitive_bitwidth // 8
    delta = (tl.load(arena_ptrs + rank) - tl.load(arena_ptrs + anchor_rank)) // 256 * (256 // elem)
    return anchor + delta + offset


@triton.jit
def has_failed(control):
    """Whether this rank's error record is set (then its tasks are skipped)."""
    return (tl.load(control + _CTL_ERROR, volatile=True) != 0).to(tl.int32)


@triton.jit
def record_failure(control, rank, task, what, index, expected, seen):
    """Fill this rank's error record unless an earlier failure did."""
    if tl.atomic_cas(control + _CTL_ERROR, tl.full([], 0, tl.int64), tl.full([], 1, tl.int64)) == 0:
        tl.store(control + _CTL_ERROR + 1, rank)
        tl.store(control + _CTL_ERROR + 2, task)
        tl.store(control + _CTL_ERROR + 3, what)
        tl.store(control + _CTL_ERROR + 4, index)
        tl.store(control + _CTL_ERROR + 5, expected)
        tl.store(control + _CTL_ERROR + 6, seen)
        tl.store(control + _CTL_ERROR + 7, tl.load(control + _CTL_EPOCH))


@triton.jit
def wait_counter_at_least(counter, expected, timeout, USE_TIMER: tl.constexpr):
    """Poll ``*counter`` (acquire, system scope) until it reaches ``expected``
    or ``timeout`` passes; returns the last value seen."""
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="sys")
    if USE_TIMER:
        start = globaltimer()
        limit = timeout.to(tl.int64) * 1000
    else:
        start = tl.full([], 0, tl.int64)
        limit = timeout.to(tl.int64)
    elapsed = start - start
    while (seen < expected) & (elapsed < limit):
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="sys")
        if USE_TIMER:
            elapsed = globaltimer() - start
        else:
            elapsed += 1
    tl.debug_barrier()
    return seen


@triton.jit
def wait_counters_at_least(counters, mask, expected, timeout, USE_TIMER: tl.constexpr):
    """Block version of ``wait_counter_at_least``: poll every ``counters[i]``
    under ``mask`` until all reach ``expected``; returns the values seen."""
    seen = tl.atomic_add(counters, 0, mask=mask, sem="acquire", scope="sys")
    missing = tl.sum(tl.where(mask & (seen < expected), 1, 0))
    if USE_TIMER:
        start = globaltimer()
        limit = timeout.to(tl.int64) * 1000
    else:
        start = tl.full([], 0, tl.int64)
        limit = timeout.to(tl.int64)
    elapsed = start - start
    while (missing > 0) & (elapsed < limit):
        seen = tl.atomic_add(counters, 0, mask=mask, sem="acquire", scope="sys")
        missing = tl.sum(tl.where(mask & (seen < expected), 1, 0))
        if USE_TIMER:
            elapsed = globaltimer() - start
        else:
            elapsed += 1
    tl.debug_barrier()
    return tl.where(mask, seen, expected)


@triton.jit
def next_task(control_row0, which):
    """Claim the next task id of counter ``which`` (one counter per launch
    phase, shared by every program of the launch; in the simulated world one
    counter serves all ranks, so all ranks' producers come first).

    Relaxed: a claim orders nothing (every cross-program dependency has its
    own release / acquire counter), and an acq_rel atomic here costs a memory
    barrier plus an L1 invalidation per task, the barrier waiting for the
    previous task's stores, remote ones included."""
    return tl.atomic_add(control_row0 + which, 1, sem="relaxed").to(tl.int32)


@triton.jit(do_not_specialize=["anchor_rank", "rank_base", "timeout", "own_experts"])
def exchange_counts_kernel(
    block_counts_ptr,  # (L, NB, E) int32: per-block histograms in, exclusive prefixes out (kernels.route)
    block_rank_stride,
    num_tokens_ptr,  # (L,) int32
    counts_all_ptr,  # (L, W, E) int64 out: the exchanged table, identical on every rank
    route_tables_ptr,  # (L, ROUTE_TABLE_ROWS, E) int32 out (kernels.route)
    tile_expert_ptr,  # (L, C) int32 out
    tile_start_ptr,  # (L, C) int32 out
    tile_end_ptr,  # (L, C) int32 out
    num_tiles_ptr,  # (L,) int32 out
    tile_order_ptr,  # (L, C) int32 out
    control_ptr,  # (L, CONTROL_WORDS) int64
    arena_ptrs,  # (W,) int64: every rank's arena base address
    i64_anchor,  # the arena of anchor_rank, as int64
    i32_anchor,  # the same, as int32
    anchor_rank,
    rank_base,
    off_counts,  # element offset (int64) of the (2, W, E) count tables
    off_count_flags,  # element offset (int64) of the (2, W) flags
    off_tile_arrivals,  # element offset (int32) of (C,)
    off_token_arrivals,  # element offset (int32) of (T_cap,)
    off_tile_done,  # element offset (int32) of (C,)
    timeout,
    own_experts,  # tile_order (TILE_ORDER): local experts whose own-rows tiles go first
    WORLD: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    TILE_CAPACITY: tl.constexpr,
    TOKEN_CAPACITY: tl.constexpr,
    PUBLISH: tl.constexpr,
    COLLECT: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_TIMER: tl.constexpr,
    TOP_K: tl.constexpr,
    EP: tl.constexpr,  # next power of two >= NUM_EXPERTS
    ELP: tl.constexpr,  # next power of two >= NUM_EXPERTS // WORLD
    BM: tl.constexpr,  # rows per GEMM tile
    ROUTE_BLOCK: tl.constexpr,  # copies per block of block_counts
    SB: tl.constexpr,  # blocks per step of the scan
    CB: tl.constexpr,  # tiles per step of the tile table
    TILE_ORDER: tl.constexpr = False,  # also write tile_order (KernelConfig.local_first)
):
    """One program per local rank.

    PUBLISH: start a new call. Zero this rank's scoreboard (its arrival
    counters and task counters: every peer bump of the previous call has
    landed, since this rank waited for all of them), bump the epoch, write
    this rank's counts into every rank's table ``[epoch % 2][rank]``, then
    release its flag there with the epoch. The release also orders the zeroing
    before any peer's next bump. Two tables, by epoch parity: a peer may
    publish call N+1 while this rank still reads call N's table, never N+2
    (publishing N+2 needs this rank's flag of N+1).

    Its counts are the totals of the per-block histograms of
    ``route_histogram_kernel``, which the scan turns into exclusive prefix
    sums in place (``route_layout_kernel`` reads them).

    COLLECT: wait (bounded) until every rank's flag shows this epoch, then copy
    the table out and derive the per-expert route tables and this rank's
    receive tiles from it (``kernels.route.write_route_tables``). A real rank does both in one launch; the simulated world
    runs PUBLISH for all ranks, then COLLECT, so no program waits on a later one.
    """
    local = tl.program_id(0)
    rank = rank_base + local
    control = control_ptr + local * _CONTROL_WORDS
    offs = tl.arange(0, BLOCK)
    if PUBLISH:
        tile_arrivals = arena_ptr(i32_anchor, arena_ptrs, anchor_rank, rank, off_tile_arrivals)
        for i in range(0, TILE_CAPACITY, BLOCK):
            tl.store(tile_arrivals + i + offs, 0, mask=i + offs < TILE_CAPACITY)
        token_arrivals = arena_ptr(i32_anchor, arena_ptrs, anchor_rank, rank, off_token_arrivals)
        for i in range(0, TOKEN_CAPACITY, BLOCK):
            tl.store(token_arrivals + i + offs, 0, mask=i + offs < TOKEN_CAPACITY)
        tile_done = arena_ptr(i32_anchor, arena_ptrs, anchor_rank, rank, off_tile_done)
        for i in range(0, TILE_CAPACITY, BLOCK):
            tl.store(tile_done + i + offs, 0, mask=i + offs < TILE_CAPACITY)
        tl.store(control + offs, 0, mask=(offs < _CTL_ERROR) & (offs != _CTL_EPOCH))  # every task counter
        epoch = tl.load(control + _CTL_EPOCH) + 1
        tl.store(control + _CTL_EPOCH, epoch)
        parity = epoch % 2
        num_blocks = tl.cdiv(tl.load(num_tokens_ptr + local) * TOP_K, ROUTE_BLOCK)
        counts = scan_block_counts(block_counts_ptr + local.to(tl.int64) * block_rank_stride, num_blocks,
                                   NUM_EXPERTS, EP, SB).to(tl.int64)
        experts = tl.arange(0, EP)
        for peer in range(WORLD):
            table = arena_ptr(i64_anchor, arena_ptrs, anchor_rank, peer, off_counts)
            row = table + (parity * WORLD + rank) * NUM_EXPERTS
            tl.store(row + experts, counts, mask=experts < NUM_EXPERTS)
        tl.debug_barrier()
        for peer in range(WORLD):
            flags = arena_ptr(i64_anchor, arena_ptrs, anchor_rank, peer, off_count_flags)
            tl.atomic_xchg(flags + parity * WORLD + rank, epoch, sem="release", scope="sys")
    if COLLECT:
        epoch = tl.load(control + _CTL_EPOCH)
        parity = epoch % 2
        flags = arena_ptr(i64_anchor, arena_ptrs, anchor_rank, rank, off_count_flags) + parity * WORLD
        for source in range(WORLD):
            seen = wait_counter_at_least(flags + source, epoch, timeout, USE_TIMER)
            if seen < epoch:
                record_failure(control, rank, -1, _WAIT_COUNTS_FLAG, source, epoch, seen)
        table = arena_ptr(i64_anchor, arena_ptrs, anchor_rank, rank, off_counts) + parity * WORLD * NUM_EXPERTS
        total: tl.constexpr = WORLD * NUM_EXPERTS
        for i in range(0, total, BLOCK):
            value = tl.load(table + i + offs, mask=i + offs < total, cache_modifier=".cg")
            tl.store(counts_all_ptr + local * total + i + offs, value, mask=i + offs < total)
        write_route_tables(
            table, rank, route_tables_ptr + local * (_ROUTE_TABLE_ROWS * NUM_EXPERTS),
            tile_expert_ptr + local * TILE_CAPACITY, tile_start_ptr + local * TILE_CAPACITY,
            tile_end_ptr + local * TILE_CAPACITY, num_tiles_ptr + local, tile_order_ptr + local * TILE_CAPACITY,
            own_experts, WORLD, NUM_EXPERTS, EP, ELP, BM, TILE_CAPACITY, CB, TILE_ORDER,
        )
