"""The layout-free sums of ``kernels.ordered_sums`` add in the order their
docstrings state, on random fp32 data whose every order gives other bits.

On a GPU they replace ``tl.sum`` for the router-score gradients (da_combine),
whose layout-ordered sums changed bits with ``block_m`` and
``reduce_block_tokens``; their bits there are checked by
``tests/gpu/test_gpu_schedule_bits.py``. Here, in Triton's interpreter, the
order itself: a sum that followed numpy's (``tl.sum`` in the interpreter) or
any other order fails these tests.
"""

from interpreter_env import request_interpreter

request_interpreter()  # before anything defines a Triton kernel

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from titan_uniep.kernels.ordered_sums import ordered_partials_sum, pairwise_row_sum

if not isinstance(tl.standard.cdiv, InterpretedFunction):
    pytest.skip("Triton was imported before TRITON_INTERPRET=1; run in a subprocess", allow_module_level=True)


@triton.jit
def _row_sums(x, out, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows, cols = tl.arange(0, ROWS), tl.arange(0, COLS)
    tl.store(out + rows, pairwise_row_sum(tl.load(x + rows[:, None] * COLS + cols[None, :]), ROWS))


@triton.jit
def _partial_sums(parts, out, num_rows, ROWS: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, ROWS)
    mask = rows < num_rows
    tl.store(out + rows, ordered_partials_sum(parts + rows * N, mask, N), mask=mask)


def _wide_range(gen, *shape) -> torch.Tensor:
    """Values over many magnitudes, so that every summation order rounds differently."""
    return torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-12, 12, shape, generator=gen).float())


@pytest.mark.parametrize("rows,cols", [(1, 256), (4, 16), (16, 128), (2, 2), (2, 1)])
def test_pairwise_row_sum_adds_adjacent_columns_in_rounds(rows, cols):
    x = _wide_range(torch.Generator().manual_seed(rows * 1000 + cols), rows, cols)
    got = torch.full((rows,), float("nan"))
    _row_sums[(1,)](x, got, rows, cols)
    want = x.numpy().copy()
    while want.shape[1] > 1:  # fp32 adds, as the kernel does them
        want = want[:, 0::2] + want[:, 1::2]
    assert np.array_equal(got.numpy(), want[:, 0])
    if cols >= 16:  # the order matters for such data: numpy's own sum (tl.sum here) rounds otherwise
        assert not np.array_equal(got.numpy(), x.numpy().sum(axis=1)), "data too easy to tell the orders apart"


@pytest.mark.parametrize("n", [1, 6, 11])
def test_ordered_partials_sum_adds_left_to_right_and_zeroes_masked_rows(n):
    rows, used = 8, 5
    parts = _wide_range(torch.Generator().manual_seed(n), rows, n)
    got = torch.full((rows,), float("nan"))
    _partial_sums[(1,)](parts, got, used, rows, n)
    want = parts.numpy()[:, 0].copy()
    for j in range(1, n):
        want = want + parts.numpy()[:, j]
    assert np.array_equal(got.numpy()[:used], want[:used])
    assert torch.isnan(got[used:]).all(), "a row off the mask was written"
