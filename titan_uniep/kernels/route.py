"""The deterministic layout (``titan_uniep.layout``) on the device, in Triton.

``layout.compute_layout`` + ``compute_tiles`` are about 45 small torch ops;
at qwen3-like sizes their launches cost as much host time as the whole
layer's GPU time. The same arrays come from three launches here, bitwise
equal to the torch functions (``tests/test_kernels.py`` asserts it; the torch
version stays the one definition and the oracle):

1. ``route_histogram_kernel`` (grid: copy blocks x local ranks): copies per
   expert in each block of ``BLOCK`` flat copy ids ``j = t * K + k``, into
   ``block_counts`` ``(NB, E) int32``.
2. ``exchange_counts_kernel`` (grid: local ranks x ``count_parts(E)``):
   publishes this rank's per-expert counts into every peer's arena and
   collects theirs (epoch-tagged flags, bounded waits), using two helpers:
   ``scan_block_counts`` turns a part's columns of ``block_counts`` into
   exclusive prefix sums over blocks in place and returns the per-expert
   totals the part publishes, and ``write_route_tables`` turns the exchanged
   ``(W, E)`` table into the per-expert tables. The scan is a chain of
   dependent steps over the blocks; split by expert columns, its parts run
   side by side, and the last part to finish (a ticket) releases the flags
   and collects.
3. ``route_layout_kernel`` (grid: copy blocks, at least the tile chunks, x
   local ranks): for every copy,
   ``within`` = copies of its expert in earlier blocks (the prefix) + earlier
   in its own block, then ``dest_rank``, ``dest_slot``, ``dest_tile``; and
   this rank's receive tiles, a chunk of them per program (``write_tile_chunk``;
   with ``LayerParams.local_first`` the exchange writes them, since its
   ``tile_order`` reads them).

Per-expert tables, ``route_tables`` ``(ROUTE_TABLE_ROWS, E) int32`` per local
rank (``e`` global expert, ``s`` this rank):

- ``ROW_SLOT_BASE``: ``expert_base[e] + src_prefix[s, e]``: slot of this rank's
  first copy of ``e`` on ``e``'s owner; ``dest_slot = ROW_SLOT_BASE[e] + within``;
- ``ROW_SRC_PREFIX``: ``src_prefix[s, e]``, copies of lower ranks for ``e``;
- ``ROW_TILE_BASE``: first tile of ``e`` on its owner;
  ``dest_tile = ROW_TILE_BASE[e] + (src_prefix[s, e] + within) // block_m``;
- ``ROW_EXPERT_BASE``: ``expert_base[e]``, first slot of ``e`` on its owner;
- ``ROW_ROWS``: slots of ``e`` on its owner (all sources).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from .scoreboard import (
    CONTROL_WORDS,
    CTL_COUNT_PARTS,
    CTL_EPOCH,
    CTL_ERROR,
    WAIT_COUNTS_FLAG,
    abort_word,
    arena_ptr,
    has_failed,
    wait_counter_at_least,
    wait_failed,
)

ROW_SLOT_BASE, ROW_SRC_PREFIX, ROW_TILE_BASE, ROW_EXPERT_BASE, ROW_ROWS = range(5)
ROUTE_TABLE_ROWS = 5
# The exchange holds one row of all experts in registers.
MAX_EXPERTS = 1024

_ROW_SLOT_BASE = tl.constexpr(ROW_SLOT_BASE)
_ROW_SRC_PREFIX = tl.constexpr(ROW_SRC_PREFIX)
_ROW_TILE_BASE = tl.constexpr(ROW_TILE_BASE)
_ROW_EXPERT_BASE = tl.constexpr(ROW_EXPERT_BASE)
_ROW_ROWS = tl.constexpr(ROW_ROWS)
_ROUTE_TABLE_ROWS = tl.constexpr(ROUTE_TABLE_ROWS)
_CTL_EPOCH = tl.constexpr(CTL_EPOCH)
_CTL_COUNT_PARTS = tl.constexpr(CTL_COUNT_PARTS)
_CTL_ERROR = tl.constexpr(CTL_ERROR)
_CONTROL_WORDS = tl.constexpr(CONTROL_WORDS)
_WAIT_COUNTS_FLAG = tl.constexpr(WAIT_COUNTS_FLAG)


def route_block(num_experts: int) -> int:
    """Copies per block of the histogram/layout kernels: a (block, experts)
    one-hot and a (block, block) comparison stay around 16K elements."""
    return max(16, min(128, 16384 // triton.next_power_of_2(num_experts)))


def num_route_blocks(num_tokens: int, top_k: int, num_experts: int) -> int:
    return -(-num_tokens * top_k // route_block(num_experts))


# Experts (columns of block_counts) per part of the counts exchange's scan.
PART_EXPERTS = 16
MAX_PARTS = 32


def count_parts(num_experts: int, part_experts: int = PART_EXPERTS) -> int:
    """Programs per local rank of the counts exchange: one per
    ``part_experts`` columns of the (power-of-two padded) experts."""
    return max(1, min(MAX_PARTS, triton.next_power_of_2(num_experts) // part_experts))


@triton.jit
def local_expert_rows(tables_ptr, local, rank, expert, NUM_EXPERTS_LOCAL: tl.constexpr, NUM_EXPERTS: tl.constexpr):
    """First slot and row count of ``rank``'s local expert ``expert``, read from
    local rank ``local``'s tables (``tables_ptr``: ``(L, ROUTE_TABLE_ROWS, E)``)."""
    tables = tables_ptr + local * (_ROUTE_TABLE_ROWS * NUM_EXPERTS) + rank * NUM_EXPERTS_LOCAL + expert
    return tl.load(tables + _ROW_EXPERT_BASE * NUM_EXPERTS), tl.load(tables + _ROW_ROWS * NUM_EXPERTS)


@triton.jit
def used_slots(tables_ptr, local, rank, NUM_EXPERTS_LOCAL: tl.constexpr, NUM_EXPERTS: tl.constexpr):
    """Slots in use on ``rank``: its experts' rows are back to back in expert
    order, so the last local expert's end."""
    first, rows = local_expert_rows(tables_ptr, local, rank, NUM_EXPERTS_LOCAL - 1, NUM_EXPERTS_LOCAL, NUM_EXPERTS)
    return first + rows


@triton.jit
def _num_tokens_of(num_tokens_ptr, local, host_num_tokens, TOKENS_FROM_HOST: tl.constexpr):
    if TOKENS_FROM_HOST:
        return host_num_tokens
    else:
        return tl.load(num_tokens_ptr + local)


@triton.jit(do_not_specialize=["host_num_tokens"])
def route_histogram_kernel(
    indices_ptr,  # (L, T, K) int: global expert of each copy
    index_rank_stride,
    num_tokens_ptr,  # (L,) int32: tokens per local rank (written here when TOKENS_FROM_HOST)
    host_num_tokens,  # tokens of the one local rank (TOKENS_FROM_HOST)
    block_counts_ptr,  # (L, NB, E) int32 out: copies per expert in each block
    block_rank_stride,
    NUM_EXPERTS: tl.constexpr,
    EP: tl.constexpr,  # next power of two >= NUM_EXPERTS
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    TOKENS_FROM_HOST: tl.constexpr,
):
    """Program (b, l): histogram of local rank l's copies ``[b * BLOCK, (b + 1) * BLOCK)``."""
    block = tl.program_id(0)
    local = tl.program_id(1)
    num_tokens = _num_tokens_of(num_tokens_ptr, local, host_num_tokens, TOKENS_FROM_HOST)
    if TOKENS_FROM_HOST:
        # Later launches read the count from the device (no per-call host-to-device copy).
        if block == 0:
            tl.store(num_tokens_ptr + local, num_tokens)
    num_copies = num_tokens * TOP_K
    if block * BLOCK < num_copies:
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < num_copies
        expert = tl.load(indices_ptr + local.to(tl.int64) * index_rank_stride + offs, mask=mask, other=-1).to(tl.int32)
        experts = tl.arange(0, EP)
        hits = (expert[:, None] == experts[None, :]).to(tl.int32)
        counts = tl.sum(hits, axis=0)
        row = block_counts_ptr + local.to(tl.int64) * block_rank_stride + block * NUM_EXPERTS
        tl.store(row + experts, counts, mask=experts < NUM_EXPERTS)


@triton.jit
def scan_block_counts(block_counts, num_blocks, experts, NUM_EXPERTS: tl.constexpr, EC: tl.constexpr,
                      SB: tl.constexpr):
    """Columns ``experts`` (``(EC,)``) of ``block_counts`` ``(num_blocks, E)
    int32`` per-block histograms -> exclusive prefix sums over blocks, in
    place. Returns their totals ``(EC,)`` (copies per expert; zero past
    ``NUM_EXPERTS``)."""
    mask_e = experts < NUM_EXPERTS
    running = tl.zeros([EC], dtype=tl.int32)
    b0 = 0
    while b0 < num_blocks:
        blocks = b0 + tl.arange(0, SB)
        mask = (blocks < num_blocks)[:, None] & mask_e[None, :]
        ptrs = block_counts + blocks[:, None] * NUM_EXPERTS + experts[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)
        inclusive = tl.cumsum(counts, axis=0)
        tl.store(ptrs, inclusive - counts + running[None, :], mask=mask)
        running += tl.sum(counts, axis=0)
        b0 += SB
    return running


@triton.jit
def write_tile_chunk(tables, rank, c0, tile_expert_ptr, tile_start_ptr, tile_end_ptr, NUM_EXPERTS: tl.constexpr,
                     NUM_LOCAL: tl.constexpr, ELP: tl.constexpr, BM: tl.constexpr, TILE_CAPACITY: tl.constexpr,
                     CB: tl.constexpr):
    """Tiles ``[c0, c0 + CB)`` of ``rank``'s receive tiles (its experts
    ``rank * NUM_LOCAL + l`` cut into tiles of ``BM`` rows) from its per-expert
    ``tables``: expert, first and end slot of each (zeros past the last)."""
    mine = rank * NUM_LOCAL
    local_experts = tl.arange(0, ELP)
    mask_l = local_experts < NUM_LOCAL
    my_tile_base = tl.load(tables + _ROW_TILE_BASE * NUM_EXPERTS + mine + local_experts, mask=mask_l, other=0)
    my_rows = tl.load(tables + _ROW_ROWS * NUM_EXPERTS + mine + local_experts, mask=mask_l, other=0)
    my_tiles_end = tl.where(mask_l, my_tile_base + (my_rows + (BM - 1)) // BM, 1 << 30)
    tile = c0 + tl.arange(0, CB)
    # searchsorted(cumsum(my_tiles), tile, right=True)
    expert = tl.sum((my_tiles_end[None, :] <= tile[:, None]).to(tl.int32), axis=1)
    used = expert < NUM_LOCAL
    expert = tl.minimum(expert, NUM_LOCAL - 1)
    base = tl.load(tables + _ROW_EXPERT_BASE * NUM_EXPERTS + mine + expert)
    first_tile = tl.load(tables + _ROW_TILE_BASE * NUM_EXPERTS + mine + expert)
    expert_rows = tl.load(tables + _ROW_ROWS * NUM_EXPERTS + mine + expert)
    start = base + (tile - first_tile) * BM
    end = tl.minimum(start + BM, base + expert_rows)
    in_range = tile < TILE_CAPACITY
    tl.store(tile_expert_ptr + tile, tl.where(used, expert, 0), mask=in_range)
    tl.store(tile_start_ptr + tile, tl.where(used, start, 0), mask=in_range)
    tl.store(tile_end_ptr + tile, tl.where(used, end, 0), mask=in_range)


@triton.jit
def write_route_tables(
    counts_table,  # (W, E) int64: the exchanged table (peer-written: read through L2)
    rank,
    tables,  # (ROUTE_TABLE_ROWS, E) int32 out
    tile_expert_ptr,  # (C,) int32 out
    tile_start_ptr,  # (C,) int32 out
    tile_end_ptr,  # (C,) int32 out
    num_tiles_ptr,  # (1,) int32 out
    tile_order_ptr,  # (C,) int32 out: tile ids, those holding only this rank's own rows first
    own_experts,  # tile_order: only the first own_experts local experts' own-rows tiles go first
    WORLD: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EP: tl.constexpr,
    ELP: tl.constexpr,  # next power of two >= E / W
    BM: tl.constexpr,
    TILE_CAPACITY: tl.constexpr,
    CB: tl.constexpr,
    TILE_ORDER: tl.constexpr,
):
    """The per-expert tables (see the module docstring) and the number of
    this rank's receive tiles, as ``layout.compute_layout`` /
    ``compute_tiles`` define them; the receive tiles themselves only with
    ``TILE_ORDER`` (else ``route_layout_kernel`` writes them, in parallel),
    which also writes ``tile_order``: a permutation of the tile ids that puts
    first the tiles of the first ``own_experts`` local experts whose rows all
    come from this rank itself, then the others, each in id order, for
    ``LayerParams.local_first`` (a schedule choice: where rows sit is
    unchanged)."""
    NUM_LOCAL: tl.constexpr = NUM_EXPERTS // WORLD
    experts = tl.arange(0, EP)
    mask_e = experts < NUM_EXPERTS
    rows = tl.zeros([EP], dtype=tl.int32)
    src_prefix = tl.zeros([EP], dtype=tl.int32)
    for source in range(WORLD):
        counts = tl.load(counts_table + source * NUM_EXPERTS + experts, mask=mask_e, other=0,
                         cache_modifier=".cg").to(tl.int32)
        rows += counts
        src_prefix += tl.where(source < rank, counts, 0)
    tiles = (rows + (BM - 1)) // BM
    # Exclusive prefix sums inside each owner's segment of NUM_LOCAL experts:
    # global exclusive prefix minus its value at the segment's first expert,
    # gathered back through the output rows (stored, barrier, loaded).
    rows_before = tl.cumsum(rows, axis=0) - rows
    tiles_before = tl.cumsum(tiles, axis=0) - tiles
    tl.store(tables + _ROW_EXPERT_BASE * NUM_EXPERTS + experts, rows_before, mask=mask_e)
    tl.store(tables + _ROW_TILE_BASE * NUM_EXPERTS + experts, tiles_before, mask=mask_e)
    tl.debug_barrier()
    segment = (experts // NUM_LOCAL) * NUM_LOCAL
    rows_seg = tl.load(tables + _ROW_EXPERT_BASE * NUM_EXPERTS + segment, mask=mask_e, other=0)
    tiles_seg = tl.load(tables + _ROW_TILE_BASE * NUM_EXPERTS + segment, mask=mask_e, other=0)
    tl.debug_barrier()
    expert_base = rows_before - rows_seg
    tl.store(tables + _ROW_SLOT_BASE * NUM_EXPERTS + experts, expert_base + src_prefix, mask=mask_e)
    tl.store(tables + _ROW_SRC_PREFIX * NUM_EXPERTS + experts, src_prefix, mask=mask_e)
    tl.store(tables + _ROW_TILE_BASE * NUM_EXPERTS + experts, tiles_before - tiles_seg, mask=mask_e)
    tl.store(tables + _ROW_EXPERT_BASE * NUM_EXPERTS + experts, expert_base, mask=mask_e)
    tl.store(tables + _ROW_ROWS * NUM_EXPERTS + experts, rows, mask=mask_e)
    tl.debug_barrier()

    # Receive side: this rank's experts rank * NUM_LOCAL + l, cut into tiles.
    mine = rank * NUM_LOCAL
    local_experts = tl.arange(0, ELP)
    mask_l = local_experts < NUM_LOCAL
    my_rows = tl.load(tables + _ROW_ROWS * NUM_EXPERTS + mine + local_experts, mask=mask_l, other=0)
    tl.store(num_tiles_ptr, tl.sum(tl.where(mask_l, (my_rows + (BM - 1)) // BM, 0), axis=0))
    if TILE_ORDER:
        # tile_order reads the tile arrays: here they are written before it, by
        # this program (else route_layout_kernel's programs write them).
        for c0 in range(0, TILE_CAPACITY, CB):
            write_tile_chunk(tables, rank, c0, tile_expert_ptr, tile_start_ptr, tile_end_ptr, NUM_EXPERTS, NUM_LOCAL,
                             ELP, BM, TILE_CAPACITY, CB)
        _write_tile_order(counts_table, tables, tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
                          tile_order_ptr, rank, mine, own_experts, NUM_EXPERTS, TILE_CAPACITY, CB)


@triton.jit
def _write_tile_order(counts_table, tables, tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
                      tile_order_ptr, rank, mine, own_experts, NUM_EXPERTS: tl.constexpr,
                      TILE_CAPACITY: tl.constexpr, CB: tl.constexpr):
    """``tile_order``: an exclusive scan of "own rows only" over the tile ids
    (two passes: the count of such tiles, then every tile's position)."""
    tl.debug_barrier()  # the tile arrays are written
    own_tiles = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, TILE_CAPACITY, CB):
        tile = c0 + tl.arange(0, CB)
        own_tiles += tl.sum(_own_rows_only(counts_table, tables, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                                           num_tiles_ptr, tile, rank, mine, own_experts, NUM_EXPERTS,
                                           TILE_CAPACITY).to(tl.int32))
    own_before = tl.zeros([], dtype=tl.int32)
    other_before = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, TILE_CAPACITY, CB):
        tile = c0 + tl.arange(0, CB)
        in_range = tile < TILE_CAPACITY
        own = _own_rows_only(counts_table, tables, tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
                             tile, rank, mine, own_experts, NUM_EXPERTS, TILE_CAPACITY).to(tl.int32)
        other = tl.where(in_range, 1 - own, 0)
        position = tl.where(own == 1, own_before + tl.cumsum(own, axis=0) - own,
                            own_tiles + other_before + tl.cumsum(other, axis=0) - other)
        tl.store(tile_order_ptr + position, tile, mask=in_range)
        own_before += tl.sum(own, axis=0)
        other_before += tl.sum(other, axis=0)


@triton.jit
def _own_rows_only(counts_table, tables, tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr, tile, rank,
                   mine, own_experts, NUM_EXPERTS: tl.constexpr, TILE_CAPACITY: tl.constexpr):
    """Whether each tile in ``tile`` is in use, of one of the first
    ``own_experts`` local experts, and all its rows come from ``rank`` itself
    (inside an expert, rows are ordered by source rank: this rank's own are
    ``[expert_base + src_prefix, + counts[rank, e])``)."""
    in_range = tile < TILE_CAPACITY
    local_expert = tl.load(tile_expert_ptr + tile, mask=in_range, other=0)
    used = in_range & (tile < tl.load(num_tiles_ptr)) & (local_expert < own_experts)
    expert = mine + local_expert
    own_first = (tl.load(tables + _ROW_EXPERT_BASE * NUM_EXPERTS + expert, mask=used, other=0)
                 + tl.load(tables + _ROW_SRC_PREFIX * NUM_EXPERTS + expert, mask=used, other=0))
    own_rows = tl.load(counts_table + rank * NUM_EXPERTS + expert, mask=used, other=0, cache_modifier=".cg")
    start = tl.load(tile_start_ptr + tile, mask=used, other=0)
    end = tl.load(tile_end_ptr + tile, mask=used, other=0)
    return used & (start >= own_first) & (end <= own_first + own_rows.to(tl.int32))


@triton.jit(do_not_specialize=["rank_base"])
def route_layout_kernel(
    indices_ptr,  # (L, T, K) int: global expert of each copy
    index_rank_stride,
    num_tokens_ptr,  # (L,) int32
    block_counts_ptr,  # (L, NB, E) int32: exclusive prefix over blocks (after the exchange)
    block_rank_stride,
    route_tables_ptr,  # (L, ROUTE_TABLE_ROWS, E) int32
    dest_rank_ptr,  # (L, T_cap, K) int32 out
    dest_slot_ptr,  # (L, T_cap, K) int32 out
    dest_tile_ptr,  # (L, T_cap, K) int32 out
    dest_rank_stride,
    tile_expert_ptr,  # (L, C) int32 out (WRITE_TILES)
    tile_start_ptr,  # (L, C) int32 out (WRITE_TILES)
    tile_end_ptr,  # (L, C) int32 out (WRITE_TILES)
    rank_base,
    NUM_EXPERTS: tl.constexpr,
    WORLD: tl.constexpr,
    TOP_K: tl.constexpr,
    BM: tl.constexpr,
    BLOCK: tl.constexpr,
    ELP: tl.constexpr,  # next power of two >= NUM_EXPERTS // WORLD
    TILE_CAPACITY: tl.constexpr,
    CB: tl.constexpr,  # tiles per program of the tile table
    WRITE_TILES: tl.constexpr,  # the receive tiles are written here (not by the exchange: no tile_order)
):
    """Program (b, l): destination rank, slot and tile of local rank l's copies
    ``[b * BLOCK, (b + 1) * BLOCK)``. An expert id outside ``[0, E)`` gets
    rank and slot -1 (the dispatch reports it as a bad slot). With
    ``WRITE_TILES``, programs ``b < cdiv(TILE_CAPACITY, CB)`` also write the
    receive tiles ``[b * CB, (b + 1) * CB)`` (the grid has at least as many)."""
    NUM_LOCAL: tl.constexpr = NUM_EXPERTS // WORLD
    block = tl.program_id(0)
    local = tl.program_id(1)
    if WRITE_TILES:
        if block * CB < TILE_CAPACITY:
            tiles = local * TILE_CAPACITY
            write_tile_chunk(route_tables_ptr + local * (_ROUTE_TABLE_ROWS * NUM_EXPERTS), rank_base + local,
                             block * CB, tile_expert_ptr + tiles, tile_start_ptr + tiles, tile_end_ptr + tiles,
                             NUM_EXPERTS, NUM_LOCAL, ELP, BM, TILE_CAPACITY, CB)
    num_copies = tl.load(num_tokens_ptr + local) * TOP_K
    if block * BLOCK < num_copies:
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < num_copies
        expert = tl.load(indices_ptr + local.to(tl.int64) * index_rank_stride + offs, mask=mask, other=-1).to(tl.int32)
        valid = mask & (expert >= 0) & (expert < NUM_EXPERTS)
        expert = tl.where(valid, expert, 0)
        # Rank among this block's copies of the same expert, in flat-id order
        # (the stable sort of compute_layout).
        earlier = tl.arange(0, BLOCK)[None, :] < tl.arange(0, BLOCK)[:, None]
        same = (expert[None, :] == expert[:, None]) & earlier & valid[None, :]
        in_block = tl.sum(same.to(tl.int32), axis=1)
        prefix = tl.load(block_counts_ptr + local.to(tl.int64) * block_rank_stride + block * NUM_EXPERTS + expert,
                         mask=valid, other=0)
        within = prefix + in_block
        tables = route_tables_ptr + local * (_ROUTE_TABLE_ROWS * NUM_EXPERTS)
        slot = tl.load(tables + _ROW_SLOT_BASE * NUM_EXPERTS + expert) + within
        src_prefix = tl.load(tables + _ROW_SRC_PREFIX * NUM_EXPERTS + expert)
        tile = tl.load(tables + _ROW_TILE_BASE * NUM_EXPERTS + expert) + (src_prefix + within) // BM
        out = local.to(tl.int64) * dest_rank_stride + offs
        tl.store(dest_rank_ptr + out, tl.where(valid, expert // NUM_LOCAL, -1), mask=mask)
        tl.store(dest_slot_ptr + out, tl.where(valid, slot, -1), mask=mask)
        tl.store(dest_tile_ptr + out, tl.where(valid, tile, 0), mask=mask)


@triton.jit
def delay_first_warp(microseconds: tl.constexpr):
    """Testing only: the first warp of the program (thread 0, which issues a
    scalar store) spins ``microseconds`` on the timer while the others go
    on; returns 0, for a value the delayed store depends on. GPU only."""
    tid = tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    start = globaltimer()
    elapsed = start - start
    while (tid < 32) & (elapsed < microseconds * 1000):
        elapsed = globaltimer() - start
    return elapsed * 0


@triton.jit(do_not_specialize=["anchor_rank", "rank_base", "timeout", "own_experts"])
def exchange_counts_kernel(
    block_counts_ptr,  # (L, NB, E) int32: per-block histograms in, exclusive prefixes out (kernels.route)
    block_rank_stride,
    counts_all_ptr,  # (L, W, E) int64 out: the exchanged table, identical on every rank
    route,  # scoreboard.Route: num_tokens in; tables, tile_expert/start/end, num_tiles, tile_order out
    control_ptr,  # (L, CONTROL_WORDS) int64
    arena,  # scoreboard.Arena
    anchor_rank,
    rank_base,
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
    PARTS: tl.constexpr,  # programs per local rank of a PUBLISH launch (the grid's second dimension)
    SB: tl.constexpr,  # blocks per step of a part's scan
    CB: tl.constexpr,  # tiles per step of the tile table
    TILE_ORDER: tl.constexpr = False,  # also write tile_order (LayerParams.local_first)
    EPOCH_STORE_DELAY_US: tl.constexpr = 0,  # LayerParams.debug_epoch_store_delay_us (testing only)
):
    """Program (l, p): part p of local rank l; the parts split the experts in
    columns of ``EP // PARTS``.

    PUBLISH: start a new call. Each part zeroes its share of this rank's
    arrival counters (every peer bump of the previous call has landed, since
    this rank waited for all of them), scans its columns of the block counts
    and writes their totals into every rank's table ``[epoch % 2][rank]``
    (``epoch``: this call's, the current one + 1), then takes a ticket (an
    acquire-release add at system scope on ``CTL_COUNT_PARTS``). The part
    that takes the last ticket has seen every part's stores: it releases
    this rank's flag in every rank's arena with the epoch (which also orders
    the zeroing before any peer's next bump), then zeroes the task counters
    (the ticket with them) and stores the epoch, for this rank's later
    launches. Two tables, by epoch parity: a peer
    may publish call N+1 while this rank still reads call N's table, never N+2
    (publishing N+2 needs this rank's flag of N+1).

    COLLECT (the last part when both run in one launch, as a real rank does;
    else the one part of a COLLECT-only launch): wait (bounded, and not at all
    once this rank has failed; every wait also gives up when the abort word
    is set: a peer failed first) until every rank's flag shows this epoch,
    then copy the table out and derive the per-expert route tables from it
    (``write_route_tables``; the receive tiles too only with ``TILE_ORDER``,
    else ``route_layout_kernel`` writes them). The simulated world
    runs PUBLISH for all ranks, then COLLECT, so no program waits on a later
    one; no part ever waits on another.
    """
    EC: tl.constexpr = EP // PARTS
    local = tl.program_id(0)
    part = tl.program_id(1)
    rank = rank_base + local
    control = control_ptr + local * _CONTROL_WORDS
    offs = tl.arange(0, BLOCK)
    collector = True
    if PUBLISH:
        tile_arrivals = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.tile_arrivals)
        token_arrivals = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.token_arrivals)
        i = part * BLOCK
        while i < TILE_CAPACITY:
            tl.store(tile_arrivals + i + offs, 0, mask=i + offs < TILE_CAPACITY)
            i += PARTS * BLOCK
        i = part * BLOCK
        while i < TOKEN_CAPACITY:
            tl.store(token_arrivals + i + offs, 0, mask=i + offs < TOKEN_CAPACITY)
            i += PARTS * BLOCK
        epoch = tl.load(control + _CTL_EPOCH) + 1
        parity = epoch % 2
        num_blocks = tl.cdiv(tl.load(route.num_tokens + local) * TOP_K, ROUTE_BLOCK)
        experts = part * EC + tl.arange(0, EC)
        counts = scan_block_counts(block_counts_ptr + local.to(tl.int64) * block_rank_stride, num_blocks, experts,
                                   NUM_EXPERTS, EC, SB).to(tl.int64)
        for peer in range(WORLD):
            table = arena_ptr(arena.i64, arena, anchor_rank, peer, arena.counts)
            row = table + (parity * WORLD + rank) * NUM_EXPERTS
            tl.store(row + experts, counts, mask=experts < NUM_EXPERTS)
        tl.debug_barrier()
        ticket = tl.atomic_add(control + _CTL_COUNT_PARTS, 1, sem="acq_rel", scope="sys")
        collector = ticket == PARTS - 1
        if collector:
            for peer in range(WORLD):
                flags = arena_ptr(arena.i64, arena, anchor_rank, peer, arena.count_flags)
                tl.atomic_xchg(flags + parity * WORLD + rank, epoch, sem="release", scope="sys")
            # This rank's own words, read by its later launches (after this one ends):
            # no peer needs them before the flags.
            tl.store(control + offs, 0, mask=(offs < _CTL_ERROR) & (offs != _CTL_EPOCH))  # every task counter
            if EPOCH_STORE_DELAY_US > 0:  # testing only: the storing warp comes late
                epoch += delay_first_warp(EPOCH_STORE_DELAY_US)
            tl.store(control + _CTL_EPOCH, epoch)
    if COLLECT:
        if collector:
            if not PUBLISH:  # (the epoch a PUBLISH launch stored)
                epoch = tl.load(control + _CTL_EPOCH)
            # else the epoch this program published, in every thread's registers: the scalar
            # store above is one thread's, and other warps reading the word back (no barrier
            # between) could see the last call's epoch, take the other table and pass the
            # wait on the last call's flags.
            parity = epoch % 2
            flags = arena_ptr(arena.i64, arena, anchor_rank, rank, arena.count_flags) + parity * WORLD
            abort = abort_word(arena, anchor_rank, rank)
            for source in range(WORLD):
                if has_failed(control) == 0:
                    seen, stopped = wait_counter_at_least(flags + source, epoch, abort, timeout, USE_TIMER, "sys")
                    if seen < epoch:
                        wait_failed(control, arena, anchor_rank, rank, -1, _WAIT_COUNTS_FLAG, source, epoch, seen,
                                    stopped, timeout, WORLD, USE_TIMER)
            table = arena_ptr(arena.i64, arena, anchor_rank, rank, arena.counts) + parity * WORLD * NUM_EXPERTS
            total: tl.constexpr = WORLD * NUM_EXPERTS
            for i in range(0, total, BLOCK):
                value = tl.load(table + i + offs, mask=i + offs < total, cache_modifier=".cg")
                tl.store(counts_all_ptr + local * total + i + offs, value, mask=i + offs < total)
            write_route_tables(
                table, rank, route.tables + local * (_ROUTE_TABLE_ROWS * NUM_EXPERTS),
                route.tile_expert + local * TILE_CAPACITY, route.tile_start + local * TILE_CAPACITY,
                route.tile_end + local * TILE_CAPACITY, route.num_tiles + local,
                route.tile_order + local * TILE_CAPACITY, own_experts, WORLD, NUM_EXPERTS, EP, ELP, BM,
                TILE_CAPACITY, CB, TILE_ORDER,
            )
