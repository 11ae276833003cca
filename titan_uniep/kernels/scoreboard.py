"""The scoreboard and the task helpers every megakernel is built from.

Cross-rank signals are counters in a rank's symmetric *arena*
(``runtime.workspace``): a producer writes data with plain stores, then
``tl.debug_barrier()`` (every thread's stores ordered before the signal) and
bumps the counter with a ``release`` atomic; a consumer polls with
``acquire`` atomics and reads the data after a barrier. Both are at system
scope when some rank of the EP group is another GPU, and at GPU scope when
every rank's buffers are on this GPU (one rank, or a simulated world):
``sync_scope``. The kernels take the scope as the constexpr ``SCOPE``; on
sm_90 a system-scope release is a ``MEMBAR.ALL.SYS`` before the atomic, a
GPU-scope one a ``MEMBAR.ALL.GPU``.
Data a peer wrote is read with ``cache_modifier=".cg"`` (L2 only): the L1 is
not coherent, and a neighbouring tile may have pulled the line in before the
peer wrote it.

Every spin is bounded (``timeout``: microseconds of ``%globaltimer`` on the
GPU, polls under the interpreter; an int32 either way, so changing it never
recompiles). Every decision that ends a wait or skips a task is the
program's, not a thread's: the timer, a scalar load and a block's copies
held by several threads can differ between warps, and the code around
holds barriers, so such values pass ``cta_any`` (a barrier with an OR over
the program's threads) before they decide. A wait that runs out writes the rank's *error record* (the first
failure wins) and the task is skipped; every later task of that rank sees the
record and skips too, so a missing peer costs one bounded wait per program,
never a hang. The host turns the record into a RuntimeError.

A failure stops the whole EP group, not only the rank that saw it: the
failing rank claims the group's first failure (a compare-and-swap on rank
0's abort words), copies its record into every rank's abort words and sets
every rank's *abort word* (system scope). Every bounded wait also polls its
own rank's abort word and gives up at once when it is set, recording that
it *stopped* (error flag ``STOPPED``) rather than failed (``FAILED``), so a
missing peer costs one bounded wait in the whole group, and every rank's
error names the rank, task and counter that failed first. The abort word is
never cleared: every later wait on that workspace gives up at once.

*Race mode* (``RACE``, a constexpr: the production kernels compile without
it; ``LayerParams.debug_race``, testing only) makes races visible where
programs run one after another (the interpreter): producers deliver a
seeded random subset of their rows (``race_draw``) and stamp each delivered
receive slot and returned row (column block) with the call's epoch; the
host bounds every wait by zero polls, so the waits' own code polls once and
a tile or token not ready is skipped (and counted), not failed; and a task
that passed its wait checks that every row it reads carries this call's
stamp, counting a *violation* otherwise (the race report, control words
from ``CTL_RACE``). ``SLACK`` (``LayerParams.debug_wait_slack``, testing
only) lowers the tile-rows and token-rows wait targets: the race the report
must catch.

Control words, ``(L, CONTROL_WORDS) int64`` per local rank (ordinary device
memory, never written by a peer): one task counter per task kind of a launch
(zeroed by the counts exchange at the start of every call), the call epoch,
the error record, the race report. Abort words, ``ABORT_WORDS int64`` in
every rank's arena (written by the peer that failed first): the claim (rank
0's is the group's), the abort word, the first failure's record.

Kernel arguments are packed: ``Arena`` (every rank's arena: base addresses,
typed anchors, the element offset of each buffer, the capacities) and
``Route`` (the call's layout arrays, ``kernels.route``).

Shared task helpers, in the order a megakernel uses them:

- ``cta_any``: a per-thread value made the program's (``has_failed``, the waits);
- ``claim_task``: the next task id of one task kind (relaxed atomic);
- ``dispatch_tasks`` / ``dispatch_task``: copy a block of tokens' rows once
  to every rank owning one of their experts (rows of one or two ``D``-wide
  parts: ``x``, or ``[x | dOut]``), write their slot entries there, release
  one arrival per copy on its tile;
- ``gemm_tile_task``: which local rank, tile and column block a GEMM task
  is, the tile's expert and slot range, and (bounded) the wait until every
  row of the tile has arrived;
- ``release_token_arrivals`` / ``release_or_defer``: a GEMM + combine
  tile's epilogue, one release per row stored into its source's buffer;
- ``wait_token_rows``: a reduce task's bounded wait for its tokens' rows;
- ``wait_failed`` / ``fail_world``: a wait that ended short, or a bad slot:
  the error record and the abort words.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

CONTROL_WORDS = 32
# Task counters (words 0-7 but the epoch; the counts exchange zeroes them every call).
CTL_DISPATCH_TASKS = 0  # dispatch tasks (dispatch_fc1, dispatch_dh)
CTL_TILE_TASKS = 1  # fc1 tiles (dispatch_fc1), dH tiles (dispatch_dh)
CTL_COMBINE_TILE_TASKS = 2  # fc2 tiles (fc2_combine), dA tiles (da_combine)
CTL_REDUCE_TASKS = 3  # reduce tasks (fc2_combine, da_combine)
# (word 4 is not used)
CTL_EPOCH = 5
CTL_OWN_DISPATCH_TASKS = 6  # dispatch of rows that stay on their rank (LayerParams.local_first)
CTL_COUNT_PARTS = 7  # parts of the counts exchange done with their columns (kernels.route)
# Error record: flag, rank, task, what, index, expected, seen, epoch.
CTL_ERROR = 8
TASK_COUNTER_WORDS = tuple(w for w in range(CTL_ERROR) if w != CTL_EPOCH)
ERROR_FIELDS = ("flag", "rank", "task", "what", "index", "expected", "seen", "epoch")
# The error record's flag: this rank's own wait ran out (or its slot was bad), or
# a wait of this rank gave up because another rank failed first (the abort word).
FAILED, STOPPED = 1, 2
# Race report (race mode only, LayerParams.debug_race): the host writes the seed and the
# keep threshold (of 2**16) and zeroes the rest before a call; per wait kind (tile rows,
# token rows) the tasks skipped (not ready), passed (every row read had arrived) and
# violating (passed the wait, but a row read had not arrived), then the first violation.
CTL_RACE = 16
RACE_FIELDS = ("seed", "keep", "tile_skipped", "tile_passed", "tile_violations", "token_skipped", "token_passed",
               "token_violations", "first_what", "first_task", "first_index", "first_row")
RACE_KEEP_ONE = 1 << 16

# Abort words (arena buffer ``abort``, int64): word 0 claims the group's first
# failure (only rank 0's is used), word 1 is the abort word every wait polls
# (the failing rank + 1), then the first failure's record.
ABORT_WORDS = 16
ABORT_FIELDS = ("claim", "code", "rank", "epoch", "task", "what", "index", "expected", "seen")

# What a failed wait was waiting for (the record's ``what``).
WAIT_COUNTS_FLAG = 1  # index: source rank whose counts never arrived
WAIT_TILE_ROWS = 2  # index: tile whose rows never all arrived
WAIT_TOKEN_ROWS = 3  # index: token whose K expert rows never all came back
BAD_SLOT = 4  # index: token whose copy's slot/tile is outside the receive buffer

_CTL_EPOCH = tl.constexpr(CTL_EPOCH)
_CTL_ERROR = tl.constexpr(CTL_ERROR)
_CTL_RACE = tl.constexpr(CTL_RACE)
_FAILED = tl.constexpr(FAILED)
_STOPPED = tl.constexpr(STOPPED)
_ABORT_CODE = tl.constexpr(ABORT_FIELDS.index("code"))
_ABORT_RECORD = tl.constexpr(ABORT_FIELDS.index("rank"))
_RACE_KEEP = tl.constexpr(CTL_RACE + RACE_FIELDS.index("keep"))
_RACE_COUNTS = tl.constexpr(CTL_RACE + RACE_FIELDS.index("tile_skipped"))
_RACE_FIRST = tl.constexpr(CTL_RACE + RACE_FIELDS.index("first_what"))
# Race-report fields within a wait kind, and the salts of the producers' draws.
_RACE_SKIPPED = tl.constexpr(0)
_RACE_PASSED = tl.constexpr(1)
_RACE_VIOLATIONS = tl.constexpr(2)
# Race mode: salts of the producers' draws (a dispatch's copies, a combine's rows).
SALT_DISPATCH, SALT_COMBINE = 0x1F3D5B79, 0x2B7E1516
_SALT_DISPATCH = tl.constexpr(SALT_DISPATCH)
_CONTROL_WORDS = tl.constexpr(CONTROL_WORDS)
_CTL_DISPATCH_TASKS = tl.constexpr(CTL_DISPATCH_TASKS)
_CTL_OWN_DISPATCH_TASKS = tl.constexpr(CTL_OWN_DISPATCH_TASKS)
_WAIT_TILE_ROWS = tl.constexpr(WAIT_TILE_ROWS)
_WAIT_TOKEN_ROWS = tl.constexpr(WAIT_TOKEN_ROWS)
_BAD_SLOT = tl.constexpr(BAD_SLOT)
# Whether the kernels compile for a GPU (``titan_uniep.kernels`` sets TRITON_INTERPRET
# without CUDA, before any kernel is defined): the interpreter runs a program as one
# thread, where every value is the program's and no barrier exists.
_ON_GPU = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


class Arena(NamedTuple):
    """Every rank's symmetric arena, as one kernel argument."""

    ptrs: torch.Tensor  # (W,) int64 base addresses
    act: torch.Tensor  # the anchor rank's arena as the activation dtype
    i32: torch.Tensor  # ... as int32
    f32: torch.Tensor  # ... as fp32
    i64: torch.Tensor  # ... as int64
    # Element offsets of the buffers, in their own dtype (runtime.workspace):
    tokens: int  # (W * T_cap, row) de-duplicated token rows
    slot_copy: int  # (S,) int32 copy id of each receive slot
    slot_score: int  # (S,) fp32 router score of each slot
    tile_arrivals: int  # (C,) int32
    returned: int  # (T_cap * K, row) expert output (or dA) of each copy
    returned_f32: int  # the same buffer's offset in fp32 elements
    token_arrivals: int  # (T_cap,) int32
    counts: int  # (2, W, E) int64
    count_flags: int  # (2, W) int64
    abort: int  # (ABORT_WORDS,) int64: claim, abort word, first failure (every rank's, written by the first to fail)
    slot_stamps: int  # (S,) int32: epoch of the call that delivered each slot (race mode only)
    row_stamps: int  # (T_cap * K, cdiv(D, 16)) int32: epoch per returned row and column block (race mode only)
    token_capacity: int  # T_cap
    slot_capacity: int  # S
    tile_capacity: int  # C


class Route(NamedTuple):
    """The call's layout (``kernels.route`` writes it), as one kernel argument."""

    dest_rank: torch.Tensor  # (L, T_cap, K) int32
    dest_slot: torch.Tensor  # (L, T_cap, K) int32
    dest_tile: torch.Tensor  # (L, T_cap, K) int32
    copy_stride: int  # T_cap * K: local-rank stride of the (L, T_cap, K) arrays (and of the scores)
    num_tokens: torch.Tensor  # (L,) int32
    tile_expert: torch.Tensor  # (L, C) int32
    tile_start: torch.Tensor  # (L, C) int32
    tile_end: torch.Tensor  # (L, C) int32
    tile_order: torch.Tensor  # (L, C) int32: tile ids, own-rows tiles first (local_first)
    tile_stride: int  # C
    num_tiles: torch.Tensor  # (L,) int32
    tables: torch.Tensor  # (L, ROUTE_TABLE_ROWS, E) int32 per-expert tables


def sync_scope(num_local_ranks: int, world_size: int) -> str:
    """The memory scope of the kernels' releases and acquires (their
    ``SCOPE``): ``"gpu"`` when every rank of the world is in this launch
    (one rank, or a simulated world: no other GPU reads or writes these
    buffers), ``"sys"`` otherwise (peers on other GPUs, over NVLink)."""
    return "gpu" if num_local_ranks == world_size else "sys"


@triton.jit
def arena_ptr(anchor, arena, anchor_rank, rank, offset):
    """Typed pointer to element ``offset`` of ``rank``'s arena (``rank`` may be
    a block: one pointer per element).

    ``anchor`` (one of ``arena``'s typed views) points at the arena of
    ``anchor_rank``; other arenas are reached as ``anchor + delta`` (one
    address space for all peers, UVA). Deliberately not an int-to-pointer
    cast: that loses the compiler's alignment knowledge, and then gathered
    GEMM rows are neither vectorised nor pipelined and every row copy to a
    peer is split into 2-byte stores. Arenas are 256-byte aligned, which the
    rounding tells the alignment analysis."""
    elem: tl.constexpr = anchor.dtype.element_ty.primitive_bitwidth // 8
    delta = (tl.load(arena.ptrs + rank) - tl.load(arena.ptrs + anchor_rank)) // 256 * (256 // elem)
    return anchor + delta + offset


@triton.jit
def cta_any(flag):
    """Whether ``flag`` (an int scalar, each thread its own) is nonzero in any
    thread of the program, as an int32 0 / 1 that every thread holds alike.

    A scalar ``tl.load`` is issued by every thread, and the timer is read by
    every thread: warps can see different values. A branch or a loop exit
    that such a value decides, around code that holds a barrier (a
    broadcast atomic, ``tl.sum``, ``tl.debug_barrier``), must take it from
    here: ``bar.red.or``, itself a barrier, so every thread of the program
    calls it (never under a branch the threads may disagree on). The
    interpreter runs a program as one thread: there it is ``flag != 0``."""
    if _ON_GPU:
        return tl.inline_asm_elementwise(
            "{ .reg .pred %any_in, %any_out; setp.ne.s32 %any_in, $1, 0; bar.red.or.pred %any_out, 0, %any_in; "
            "selp.s32 $0, 1, 0, %any_out; }",
            "=r,r", [(flag != 0).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return (flag != 0).to(tl.int32)


@triton.jit
def has_failed(control):
    """Whether this rank's error record is set (then its tasks are skipped):
    the same answer in every thread (``cta_any``), since another program may
    set the record while this one's warps read it."""
    return cta_any(tl.load(control + _CTL_ERROR, volatile=True))


@triton.jit
def abort_word(arena, anchor_rank, rank):
    """Pointer to ``rank``'s abort word: nonzero (the failing rank + 1) once
    some rank of the group failed; every wait polls it."""
    return arena_ptr(arena.i64, arena, anchor_rank, rank, arena.abort) + _ABORT_CODE


@triton.jit
def record_failure(control, rank, task, what, index, expected, seen, flag):
    """Fill this rank's error record unless an earlier failure did (``flag``:
    ``FAILED`` or ``STOPPED``)."""
    # (a claim on this rank's own record: the record is read by the host after the kernel)
    if tl.atomic_cas(control + _CTL_ERROR, tl.full([], 0, tl.int64), tl.full([], flag, tl.int64), sem="relaxed",
                     scope="gpu") == 0:
        tl.store(control + _CTL_ERROR + 1, rank)
        tl.store(control + _CTL_ERROR + 2, task)
        tl.store(control + _CTL_ERROR + 3, what)
        tl.store(control + _CTL_ERROR + 4, index)
        tl.store(control + _CTL_ERROR + 5, expected)
        tl.store(control + _CTL_ERROR + 6, seen)
        tl.store(control + _CTL_ERROR + 7, tl.load(control + _CTL_EPOCH))


@triton.jit
def fail_world(control, arena, anchor_rank, rank, task, what, index, expected, seen, timeout,
               WORLD: tl.constexpr, USE_TIMER: tl.constexpr):
    """This rank failed (a wait ran out, a bad slot): record it, then stop
    every rank. The first failing rank of the group (the one whose claim on
    rank 0's abort words succeeds) copies its record into every rank's abort
    words and then sets their abort words (release, system scope); a later
    one waits (bounded) until the first one's record has reached its own
    arena, so its error can name it."""
    record_failure(control, rank, task, what, index, expected, seen, _FAILED)
    claim = arena_ptr(arena.i64, arena, anchor_rank, 0, arena.abort)  # (the claim is word 0)
    code = rank.to(tl.int64) + 1
    # Relaxed: the claim carries no data (the record goes out with the abort words'
    # release below, a loser reads it after its own abort word's acquire).
    if tl.atomic_cas(claim, tl.full([], 0, tl.int64), code, sem="relaxed", scope="sys") == 0:
        epoch = tl.load(control + _CTL_EPOCH)
        for peer in range(WORLD):
            words = arena_ptr(arena.i64, arena, anchor_rank, peer, arena.abort) + _ABORT_RECORD
            tl.store(words, rank)
            tl.store(words + 1, epoch)
            tl.store(words + 2, task)
            tl.store(words + 3, what)
            tl.store(words + 4, index)
            tl.store(words + 5, expected)
            tl.store(words + 6, seen)
        tl.debug_barrier()  # every record before any abort word
        for peer in range(WORLD):
            tl.atomic_xchg(abort_word(arena, anchor_rank, peer), code, sem="release", scope="sys")
    else:
        own = abort_word(arena, anchor_rank, rank)
        wait_counter_at_least(own, 1, own, timeout, USE_TIMER, "sys")  # (the abort word is its own stop)


@triton.jit
def wait_failed(control, arena, anchor_rank, rank, task, what, index, expected, seen, stopped, timeout,
                WORLD: tl.constexpr, USE_TIMER: tl.constexpr):
    """A bounded wait of this rank ended short: on the abort word (``stopped``,
    as the wait returned it: another rank failed first; record that this rank
    stopped), or at its own bound (``fail_world``; if another rank claimed
    the first failure meanwhile, this record still says this rank timed out)."""
    if stopped != 0:
        record_failure(control, rank, task, what, index, expected, seen, _STOPPED)
    else:
        fail_world(control, arena, anchor_rank, rank, task, what, index, expected, seen, timeout, WORLD, USE_TIMER)


@triton.jit
def wait_counter_at_least(counter, expected, abort, timeout, USE_TIMER: tl.constexpr, SCOPE: tl.constexpr):
    """Poll ``*counter`` (acquire at ``SCOPE``: ``sync_scope``) until it reaches ``expected``,
    ``timeout`` passes or the abort word ``*abort`` is set; returns the last
    value seen and whether the wait stopped on the abort word (1 / 0; the
    abort word is read only while the counter is short).

    The acquire is one thread's, broadcast through shared memory behind a
    barrier, so ``seen`` is every thread's; the timer and the abort word are
    read by every thread, so whether to poll again is decided by
    ``cta_any`` over them: every thread leaves the loop at the same poll."""
    seen = tl.atomic_add(counter, 0, sem="acquire", scope=SCOPE)
    if USE_TIMER:
        start = globaltimer()
        limit = timeout.to(tl.int64) * 1000
    else:
        start = tl.full([], 0, tl.int64)
        limit = timeout.to(tl.int64)
    elapsed = start - start
    stop = tl.full([], 0, tl.int64)
    waiting = (seen < expected) & (cta_any(elapsed >= limit) == 0)  # (a zero bound: one poll, race mode)
    while waiting:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope=SCOPE)
        stop = tl.load(abort, volatile=True)
        if USE_TIMER:
            elapsed = globaltimer() - start
        else:
            elapsed += 1
        waiting = (seen < expected) & (cta_any((stop != 0) | (elapsed >= limit)) == 0)
    stopped = cta_any(stop)
    tl.debug_barrier()
    return seen, stopped


@triton.jit
def wait_counters_at_least(counters, mask, expected, abort, timeout, USE_TIMER: tl.constexpr,
                           SCOPE: tl.constexpr):
    """Block version of ``wait_counter_at_least``: poll every ``counters[i]``
    under ``mask`` until all reach ``expected`` (or the timeout, or the abort
    word); returns the values seen and whether it stopped on the abort word.

    A block's elements may be held by several threads each (a block smaller
    than the program), each polling its own copy: the loop goes on while any
    thread still misses a counter and no thread gave up (``cta_any``), so
    every thread leaves it at the same poll, and a caller decides from
    ``cta_any`` of what its own copies show."""
    seen = tl.atomic_add(counters, 0, mask=mask, sem="acquire", scope=SCOPE)
    missing = tl.sum(tl.where(mask & (seen < expected), 1, 0))
    if USE_TIMER:
        start = globaltimer()
        limit = timeout.to(tl.int64) * 1000
    else:
        start = tl.full([], 0, tl.int64)
        limit = timeout.to(tl.int64)
    elapsed = start - start
    stop = tl.full([], 0, tl.int64)
    waiting = (cta_any(missing) != 0) & (cta_any(elapsed >= limit) == 0)
    while waiting:
        seen = tl.atomic_add(counters, 0, mask=mask, sem="acquire", scope=SCOPE)
        missing = tl.sum(tl.where(mask & (seen < expected), 1, 0))
        stop = tl.load(abort, volatile=True)
        if USE_TIMER:
            elapsed = globaltimer() - start
        else:
            elapsed += 1
        waiting = (cta_any(missing) != 0) & (cta_any((stop != 0) | (elapsed >= limit)) == 0)
    stopped = cta_any(stop)
    tl.debug_barrier()
    return tl.where(mask, seen, expected), stopped


# ---- race mode (testing only) ---------------------------------------------------


@triton.jit
def race_draw(control, key, salt):
    """Race mode: whether a producer delivers item ``key`` (int, any shape)
    this call: a seeded hash of the item under the keep threshold (both set
    by the host in the race report). Every constant is below 2**31 and every
    product below 2**63: the same bits in the interpreter and on a GPU."""
    seed = tl.load(control + _CTL_RACE)
    keep = tl.load(control + _RACE_KEEP)
    h = (key.to(tl.int64) * 0x2545F491 + seed * 0x9E3779B + salt) & 0x7FFFFFFF
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0x7FFFFFFF
    h = ((h ^ (h >> 12)) * 0x297A2D39) & 0x7FFFFFFF
    h = h ^ (h >> 15)
    return (h & 0xFFFF) < keep


@triton.jit
def race_note(control, kind, field):
    """Race mode: count one task of wait kind ``kind`` (0 tile rows, 1 token
    rows) as skipped, passed or violating (``field``)."""
    tl.atomic_add(control + _RACE_COUNTS + kind * 3 + field, 1, sem="relaxed", scope="gpu")


@triton.jit
def race_violation(control, kind, what, task, index, row):
    """Race mode: a task passed its wait but row ``row`` (a slot, or a
    returned row) had not arrived; count it and keep the first."""
    race_note(control, kind, _RACE_VIOLATIONS)
    if tl.atomic_cas(control + _RACE_FIRST, tl.full([], 0, tl.int64), tl.full([], what, tl.int64), sem="relaxed",
                     scope="gpu") == 0:
        tl.store(control + _RACE_FIRST + 1, task)
        tl.store(control + _RACE_FIRST + 2, index)
        tl.store(control + _RACE_FIRST + 3, row)


@triton.jit
def race_rows_delivered(arena, anchor_rank, rank, control, offs_m, mask_m, col_block, salt):
    """Race mode: which rows ``offs_m`` (slots of ``rank``) a GEMM + combine
    tile delivers to their sources: those whose copy arrived this call (its
    slot stamp; any other slot names no valid source), then a seeded draw
    per (slot, column block)."""
    epoch = tl.load(control + _CTL_EPOCH).to(tl.int32)
    stamps = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.slot_stamps)
    arrived = tl.load(stamps + offs_m, mask=mask_m, other=0, cache_modifier=".cg") == epoch
    key = (rank.to(tl.int64) * arena.slot_capacity + offs_m) * 1024 + col_block
    return mask_m & arrived & race_draw(control, key, salt)


@triton.jit
def race_stamp_rows(arena, anchor_rank, control, source, row, col_block, mask, COL_BLOCKS: tl.constexpr):
    """Race mode: stamp column block ``col_block`` of each stored returned
    ``row`` at its ``source`` with this call's epoch (before the release)."""
    stamps = arena_ptr(arena.i32, arena, anchor_rank, source, arena.row_stamps)
    epoch = tl.load(control + _CTL_EPOCH).to(tl.int32)
    tl.store(stamps + row * COL_BLOCKS + col_block, tl.zeros_like(row).to(tl.int32) + epoch, mask=mask)


@triton.jit
def claim_task(control_row0, which):
    """Claim the next task id of counter ``which`` (one counter per task kind,
    shared by every program of the launch; in the simulated world one counter
    serves all ranks, so all ranks' producers come first).

    Relaxed: a claim orders nothing (every cross-program dependency has its
    own release / acquire counter), and an acq_rel atomic here costs a memory
    barrier plus an L1 invalidation per task, the barrier waiting for the
    previous task's stores, remote ones included."""
    return tl.atomic_add(control_row0 + which, 1, sem="relaxed", scope="gpu").to(tl.int32)


@triton.jit
def max_over_ranks(values_ptr, NUM_LOCAL: tl.constexpr):
    """The largest of the ``NUM_LOCAL`` local ranks' values (token or tile counts)."""
    most = 0
    for local in range(NUM_LOCAL):
        most = tl.maximum(most, tl.load(values_ptr + local))
    return most


# ---- dispatch ----------------------------------------------------------------


@triton.jit
def token_rows_of(arena, anchor_rank, rank, local, x_ptr, g_ptr, x_rank_stride, WORLD: tl.constexpr,
                  DIM: tl.constexpr):
    """Where the GEMM tiles of ``rank`` gather token row ``r = copy // K``
    from: ``(x rows, dOut rows)``, row ``r`` at ``+ r * stride``. With peers,
    the dispatched rows in the rank's arena (``tokens``: stride ``2 * DIM``,
    rows ``[x | dOut]``, in the backward; ``DIM``, x alone, in the forward).
    With one rank (``WORLD`` 1) every copy is the rank's own: the tiles read
    ``x_ptr`` / ``g_ptr`` of local rank ``local`` in place (stride ``DIM``;
    row ``rank * T_cap + t`` is their row ``t``), so the dispatch copies no
    row and the arena holds none."""
    if WORLD == 1:
        shift = local.to(tl.int64) * x_rank_stride - rank.to(tl.int64) * arena.token_capacity * DIM
        x_rows = x_ptr + shift
        g_rows = g_ptr + shift
    else:
        x_rows = arena_ptr(arena.act, arena, anchor_rank, rank, arena.tokens)
        g_rows = x_rows + DIM
    return x_rows, g_rows


@triton.jit
def dispatch_part(dest, rank, part):
    """Which copies a dispatch task handles: all (``part`` 0), those that stay
    on ``rank`` itself (1) or those that go to other ranks (2)."""
    own = dest == rank
    which = rank * 0 + part  # a tensor, whether ``part`` is a constant or not
    return (which == 0) | ((which == 1) & own) | ((which == 2) & (own == 0))


@triton.jit
def dispatch_task(
    task, tasks_per_rank, rank_base, control_ptr, x_ptr, g_ptr, x_rank_stride, scores_ptr, route, arena,
    anchor_rank, silent_rank, part,
    WORLD: tl.constexpr, DIM: tl.constexpr, TOP_K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    KP: tl.constexpr, ROW_PARTS: tl.constexpr, USE_TIMER: tl.constexpr, RACE: tl.constexpr, SCOPE: tl.constexpr,
):
    """``BT`` tokens of one source rank, for the destinations ``part`` selects
    (``dispatch_part``): each token's row (``ROW_PARTS`` = 1: its x row;
    2: ``[x | dOut]``, ``g_ptr`` the dOut rows) stored once at
    ``tokens[source * T_cap + t]`` of every rank owning one of its experts
    (with one rank, ``WORLD`` 1, no row is copied: see ``token_rows_of``);
    each copy's slot entries (``slot_copy``, ``slot_score``) at its slot
    there; then one release arrival per copy on its tile. ``RACE``: only a
    seeded subset of the copies (``race_draw``), each stamped with the
    call's epoch at its slot (``slot_stamps``) before its arrival."""
    ROW: tl.constexpr = ROW_PARTS * DIM
    local = task // tasks_per_rank
    rank = rank_base + local
    control = control_ptr + local * _CONTROL_WORDS
    num_tokens = tl.load(route.num_tokens + local)
    if (rank != silent_rank) & (has_failed(control) == 0):
        offs_t = (task % tasks_per_rank) * BT + tl.arange(0, BT)
        mask_t = offs_t < num_tokens
        offs_k = tl.arange(0, KP)
        every_copy = mask_t[:, None] & (offs_k < TOP_K)[None, :]
        copies = local * route.copy_stride + offs_t[:, None] * TOP_K + offs_k[None, :]
        dest = tl.load(route.dest_rank + copies, mask=every_copy, other=-1)
        token_rows = rank.to(tl.int64) * arena.token_capacity + offs_t
        src = local.to(tl.int64) * x_rank_stride + offs_t[:, None].to(tl.int64) * DIM
        if WORLD > 1:  # one rank: the GEMM tiles read x (and dOut) in place (``token_rows_of``)
            for d0 in range(0, DIM, BD):
                offs_d = d0 + tl.arange(0, BD)
                mask_d = offs_d < DIM
                mask = mask_t[:, None] & mask_d[None, :]
                x_rows = tl.load(x_ptr + src + offs_d[None, :], mask=mask)
                if ROW_PARTS == 2:
                    g_rows = tl.load(g_ptr + src + offs_d[None, :], mask=mask)
                for peer in range(WORLD):
                    goes_there = (tl.max(tl.where(dest == peer, 1, 0), axis=1) > 0) & dispatch_part(peer, rank, part)
                    tokens = arena_ptr(arena.act, arena, anchor_rank, peer, arena.tokens)
                    dst = tokens + token_rows[:, None] * ROW + offs_d[None, :]
                    there = goes_there[:, None] & mask_d[None, :]
                    tl.store(dst, x_rows, mask=there)
                    if ROW_PARTS == 2:
                        tl.store(dst + DIM, g_rows, mask=there)
        mine = every_copy & dispatch_part(dest, rank, part)
        copy_id = token_rows[:, None] * TOP_K + offs_k[None, :]
        if RACE:
            mine = mine & race_draw(control, copy_id, _SALT_DISPATCH)
        slot = tl.load(route.dest_slot + copies, mask=mine, other=0)
        tile = tl.load(route.dest_tile + copies, mask=mine, other=0)
        fits = (slot >= 0) & (slot < arena.slot_capacity) & (tile >= 0) & (tile < arena.tile_capacity)
        bad = mine & (fits == 0)
        if tl.max(bad.to(tl.int32)) > 0:
            first_bad = tl.min(tl.where(bad, offs_t[:, None], 1 << 30))
            fail_world(control, arena, anchor_rank, rank, task, _BAD_SLOT, first_bad, arena.slot_capacity,
                       tl.max(tl.where(bad, slot, 0)), rank * 0, WORLD, USE_TIMER)
        ok = mine & fits
        peer = tl.maximum(dest, 0)
        tl.store(arena_ptr(arena.i32, arena, anchor_rank, peer, arena.slot_copy) + slot, copy_id.to(tl.int32),
                 mask=ok)
        score = tl.load(scores_ptr + copies, mask=mine, other=0.0)
        tl.store(arena_ptr(arena.f32, arena, anchor_rank, peer, arena.slot_score) + slot, score, mask=ok)
        if RACE:
            epoch = tl.load(control + _CTL_EPOCH).to(tl.int32)
            stamps = arena_ptr(arena.i32, arena, anchor_rank, peer, arena.slot_stamps)
            tl.store(stamps + slot, tl.zeros_like(slot) + epoch, mask=ok)
        tl.debug_barrier()  # every thread's row and slot stores before any arrival
        tile_arrivals = arena_ptr(arena.i32, arena, anchor_rank, peer, arena.tile_arrivals)
        tl.atomic_add(tile_arrivals + tile, 1, mask=ok, sem="release", scope=SCOPE)


@triton.jit
def dispatch_tasks(
    control_ptr, x_ptr, g_ptr, x_rank_stride, scores_ptr, route, arena, anchor_rank, rank_base, silent_rank,
    num_dispatch_programs, local_first,
    NUM_LOCAL: tl.constexpr, WORLD: tl.constexpr, DIM: tl.constexpr, TOP_K: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr, KP: tl.constexpr, ROW_PARTS: tl.constexpr, USE_TIMER: tl.constexpr,
    RACE: tl.constexpr, SCOPE: tl.constexpr,
):
    """A megakernel's dispatch phase: the first ``num_dispatch_programs``
    programs claim dispatch tasks until none is left. With ``local_first``,
    every program first dispatches the rows that stay on its own rank (no
    NVLink), so the tiles holding only those can start while the others are
    sent."""
    tasks_per_rank = tl.cdiv(max_over_ranks(route.num_tokens, NUM_LOCAL), BT)
    total = NUM_LOCAL * tasks_per_rank
    for step in tl.static_range(2):
        # (arithmetic on the static step: the compiler takes no branch-defined constexpr)
        counter = _CTL_DISPATCH_TASKS + (_CTL_OWN_DISPATCH_TASKS - _CTL_DISPATCH_TASKS) * (1 - step)
        first = (local_first != 0).to(tl.int32)
        part = (1 - step) + step * 2 * first
        active = (1 - step) * first + step * (tl.program_id(0) < num_dispatch_programs).to(tl.int32)
        if active != 0:
            task = claim_task(control_ptr, counter)
            while task < total:
                dispatch_task(task, tasks_per_rank, rank_base, control_ptr, x_ptr, g_ptr, x_rank_stride, scores_ptr,
                              route, arena, anchor_rank, silent_rank, part, WORLD, DIM, TOP_K, BT, BD, KP,
                              ROW_PARTS, USE_TIMER, RACE, SCOPE)
                task = claim_task(control_ptr, counter)


# ---- GEMM tile tasks ------------------------------------------------------------


@triton.jit
def grouped_tile_task(task, num_tiles, col_blocks, GROUP_M: tl.constexpr):
    """Task -> (tile, column block), ``GROUP_M`` row tiles per column sweep
    (Triton's grouped ordering: the tiles' gathered rows stay in L2)."""
    width = GROUP_M * col_blocks
    first = (task // width) * GROUP_M
    group_size = tl.minimum(num_tiles - first, GROUP_M)
    tile = first + (task % width) % group_size
    col_block = (task % width) // group_size
    return tile, col_block


@triton.jit
def gemm_tile_task(task, route, arena, anchor_rank, rank_base, control_ptr, col_blocks, use_order, timeout,
                   NUM_LOCAL: tl.constexpr, GROUP_M: tl.constexpr, WAIT: tl.constexpr, USE_TIMER: tl.constexpr,
                   WORLD: tl.constexpr, BM: tl.constexpr, RACE: tl.constexpr, SLACK: tl.constexpr,
                   SCOPE: tl.constexpr):
    """Decode a GEMM tile task (local ranks interleaved: task -> (task % L,
    task // L); per rank, ``grouped_tile_task``; ``use_order``: tiles in
    ``route.tile_order``, local_first) and, ``WAIT``, wait (bounded) until
    every row of its tile has arrived (``SLACK`` rows fewer: a test's
    deliberate race), recording a failure otherwise. ``RACE`` (the bound is
    zero polls): short is skipped, not a failure; past the wait, every slot
    of the tile must carry this call's stamp (``race_slots_arrived``).

    Returns (ready, local rank, rank, tile, column block, local expert, first
    slot, end slot): ``ready`` when the task exists, its rank has not failed,
    its rows are there and its slots fit the receive buffer."""
    local = task % NUM_LOCAL
    rank = rank_base + local
    control = control_ptr + local * _CONTROL_WORDS
    num_tiles = tl.load(route.num_tiles + local)
    rank_task = task // NUM_LOCAL
    ready = (rank_task < num_tiles * col_blocks) & (has_failed(control) == 0)
    tile = rank_task * 0
    col_block = rank_task * 0
    expert = rank_task * 0
    m0 = rank_task * 0
    m1 = rank_task * 0
    if ready:
        tile, col_block = grouped_tile_task(rank_task, num_tiles, col_blocks, GROUP_M)
        if use_order != 0:
            tile = tl.load(route.tile_order + local * route.tile_stride + tile)
        expert = tl.load(route.tile_expert + local * route.tile_stride + tile)
        m0 = tl.load(route.tile_start + local * route.tile_stride + tile)
        m1 = tl.load(route.tile_end + local * route.tile_stride + tile)
        if WAIT:
            arrivals = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.tile_arrivals) + tile
            target = m1 - m0 - SLACK
            seen, stopped = wait_counter_at_least(arrivals, target, abort_word(arena, anchor_rank, rank), timeout,
                                                  USE_TIMER, SCOPE)
            if seen < target:
                if RACE:
                    race_note(control, 0, _RACE_SKIPPED)
                else:
                    wait_failed(control, arena, anchor_rank, rank, task, _WAIT_TILE_ROWS, tile, m1 - m0, seen,
                                stopped, timeout, WORLD, USE_TIMER)
                ready = m1 < 0
            else:
                ready = m1 <= arena.slot_capacity
                if RACE:
                    ready = ready & race_slots_arrived(arena, anchor_rank, rank, control, task, tile, m0, m1, BM)
        else:
            ready = m1 <= arena.slot_capacity
    return ready, local, rank, tile, col_block, expert, m0, m1


@triton.jit
def race_slots_arrived(arena, anchor_rank, rank, control, task, tile, m0, m1, BM: tl.constexpr):
    """Race mode, a tile task past its wait: whether every slot of the tile
    carries this call's arrival stamp; counts the task as passed, or as a
    violation (then it is skipped: its slots name no row)."""
    epoch = tl.load(control + _CTL_EPOCH).to(tl.int32)
    offs = m0 + tl.arange(0, BM)
    mask = (offs < m1) & (offs < arena.slot_capacity)
    stamps = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.slot_stamps)
    missing = mask & (tl.load(stamps + offs, mask=mask, other=0, cache_modifier=".cg") != epoch)
    arrived = cta_any(tl.max(missing.to(tl.int32))) == 0
    if arrived:
        race_note(control, 0, _RACE_PASSED)
    else:
        race_violation(control, 0, _WAIT_TILE_ROWS, task, tile, tl.min(tl.where(missing, offs, 1 << 30)))
    return arrived


@triton.jit
def matrix_descriptor(ptr, rows, COLS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, ON: tl.constexpr):
    """A tensor descriptor of the ``(rows, COLS)`` row-major matrix at ``ptr``
    in blocks of ``BR x BC`` (``ON``), else the pointer itself."""
    if ON:
        desc = tl.make_tensor_descriptor(ptr, shape=[rows, COLS], strides=[COLS, 1], block_shape=[BR, BC])
    else:
        desc = ptr
    return desc


# ---- combine ------------------------------------------------------------------


@triton.jit
def cta_barrier(x):
    """A barrier of the program's threads (``bar.sync 0``, what
    ``tl.debug_barrier`` emits) as inline PTX, returning True (a scalar the
    caller ANDs into the masks of what must follow it). Triton 3.6 does not
    software-pipeline a loop whose body holds its own barrier op
    (``LayerParams.fc2_flat_loop``); the asm has side effects, so it is
    neither removed nor moved, and the memory accesses stay on their side of
    it (``tests/test_kernels_compile.py`` checks the order in the PTX).
    ``x``: any int32 scalar (the asm's dummy input). GPU only."""
    zero = tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, 0;", "=r,r", [x], dtype=tl.int32, is_pure=False,
                                     pack=1)
    return zero == 0


@triton.jit
def release_token_arrivals(source, token, mask, arena, anchor_rank, SCOPE: tl.constexpr):
    """One release arrival (at ``SCOPE``: ``sync_scope``) per stored row on its
    source's ``token_arrivals[t]`` (the caller put a barrier between the row
    stores and this)."""
    arrivals = arena_ptr(arena.i32, arena, anchor_rank, source, arena.token_arrivals)
    tl.atomic_add(arrivals + token, 1, mask=mask, sem="release", scope=SCOPE)


@triton.jit
def release_or_defer(source, token, rows, pending_source, pending_token, pending, arena, anchor_rank,
                     DEFER: tl.constexpr, SCOPE: tl.constexpr):
    """After a tile's row stores (and a barrier): release their arrivals now,
    or (``DEFER``) keep them pending until the program's next tile has run
    its K-loop, by which time the stores have landed and the system-scope
    release finds nothing to wait for. The caller releases the pending rows
    before its next tile's stores and once after its last tile. Returns the
    pending (source, token, mask)."""
    if DEFER:
        pending_source = source
        pending_token = token
        pending = rows
    else:
        release_token_arrivals(source, token, rows, arena, anchor_rank, SCOPE)
    return pending_source, pending_token, pending


@triton.jit
def wait_token_rows(arena, anchor_rank, rank, control, task, offs_t, mask_t, expected, timeout,
                    USE_TIMER: tl.constexpr, WORLD: tl.constexpr, SCOPE: tl.constexpr, PER_TOKEN: tl.constexpr = False,
                    RACE: tl.constexpr = False, SLACK: tl.constexpr = 0, TOP_K: tl.constexpr = 1,
                    COL_BLOCKS: tl.constexpr = 1):
    """A reduce task's wait (bounded) until each of its tokens ``offs_t``
    (under ``mask_t``) has ``expected`` arrivals (one count for all, or one
    per token: ``PER_TOKEN``; ``SLACK`` fewer: a test's deliberate race);
    records a failure otherwise. Returns whether all arrived. ``RACE`` (the
    bound is zero polls): short is skipped, not a failure; past the wait,
    every column block of the ``TOP_K`` returned rows of every token must
    carry this call's stamp (``race_rows_arrived``)."""
    arrivals = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.token_arrivals) + offs_t
    target = expected - SLACK
    seen, stopped = wait_counters_at_least(arrivals, mask_t, target, abort_word(arena, anchor_rank, rank), timeout,
                                           USE_TIMER, SCOPE)
    short = mask_t & (seen < target)
    failed = cta_any(tl.max(short.to(tl.int32))) != 0  # (each thread judges the copies it holds)
    if failed:
        if RACE:
            race_note(control, 1, _RACE_SKIPPED)
        else:
            first = tl.min(tl.where(short, offs_t, 1 << 30))
            if PER_TOKEN:
                wanted = tl.max(tl.where(short, expected, 0))
            else:
                wanted = expected
            wait_failed(control, arena, anchor_rank, rank, task, _WAIT_TOKEN_ROWS, first, wanted,
                        tl.min(tl.where(short, seen, 1 << 30)), stopped, timeout, WORLD, USE_TIMER)
    elif RACE:
        failed = race_rows_arrived(arena, anchor_rank, rank, control, task, offs_t, mask_t, TOP_K, COL_BLOCKS) == 0
    return failed == 0


@triton.jit
def race_rows_arrived(arena, anchor_rank, rank, control, task, offs_t, mask_t, TOP_K: tl.constexpr,
                      COL_BLOCKS: tl.constexpr):
    """Race mode, a reduce task past its wait: whether every column block of
    its tokens' returned rows carries this call's stamp; counts the task as
    passed, or as a violation (then it is skipped)."""
    epoch = tl.load(control + _CTL_EPOCH).to(tl.int32)
    stamps = arena_ptr(arena.i32, arena, anchor_rank, rank, arena.row_stamps)
    first = tl.full([], 1 << 30, tl.int32)
    for k in range(TOP_K):
        rows = offs_t * TOP_K + k
        for col_block in range(COL_BLOCKS):
            stamp = tl.load(stamps + rows.to(tl.int64) * COL_BLOCKS + col_block, mask=mask_t, other=0,
                            cache_modifier=".cg")
            first = tl.minimum(first, tl.min(tl.where(mask_t & (stamp != epoch), rows, 1 << 30)))
    arrived = cta_any(first != 1 << 30) == 0
    if arrived:
        race_note(control, 1, _RACE_PASSED)
    else:
        race_violation(control, 1, _WAIT_TOKEN_ROWS, task, first // TOP_K, first)
    return arrived
