"""Sums whose order is fixed by the data's indices, not by a tensor's layout.

A ``tl.sum`` on a GPU adds in the order of the tensor's blocked layout: the
elements one thread holds, then across lanes, then across warps. Triton picks
that layout from the tensor's shape, the kernel's warps and the loads that
produce it, so a sum over the columns of a ``(rows, cols)`` tile gives other
bits when a schedule field changes the tile's rows (``block_m``,
``reduce_block_tokens``) or the kernel's warps. The sums here fix their order
by construction, so that every schedule point gives the same bits:

- ``pairwise_row_sum``: adjacent columns added in pairs, then adjacent pair
  sums, ... (``log2(cols)`` rounds); each round is a sum over an axis of two
  elements, which is one addition whatever the layout.
- ``ordered_partials_sum``: ``N`` partials per row read from memory and added
  one after another, ``p0 + p1 + ... + p(N-1)`` from the left.

Triton's interpreter (the CPU tests) keeps ``tl.sum``: numpy sums each row of
a tile the same way whatever the tile's rows, so its bits are already
independent of the schedule, and the interpreter's golden digests stay those
of ``tl.sum`` (callers branch on their ``INTERPRET`` constexpr).
"""

from __future__ import annotations

import triton
import triton.language as tl

# More rounds than any tile has columns of (2**16); the rounds past log2(cols) are not generated.
_MAX_ROUNDS = tl.constexpr(16)


@triton.jit
def pairwise_row_sum(v, ROWS: tl.constexpr):
    """Row sums ``(ROWS,)`` of ``v`` ``(ROWS, C)``, ``C`` a power of two:
    ``((c0 + c1) + (c2 + c3)) + ...`` in ``v``'s dtype."""
    for _ in tl.static_range(_MAX_ROUNDS):
        if v.shape[1] > 1:
            v = tl.sum(tl.reshape(v, (ROWS, v.shape[1] // 2, 2)), axis=2)
    return tl.reshape(v, (ROWS,))


@triton.jit
def ordered_partials_sum(row_ptrs, mask, N: tl.constexpr):
    """``sum_j row_ptrs[i] [j]`` for ``j = 0..N-1`` in that order, per row
    ``i`` (``row_ptrs``: each row's first partial; rows off ``mask`` give 0)."""
    total = tl.load(row_ptrs, mask=mask, other=0.0)
    for j in range(1, N):
        total += tl.load(row_ptrs + j, mask=mask, other=0.0)
    return total
