"""A shape-independent ``tl.dot`` for the Triton interpreter (tests and probes).

The interpreter computes ``tl.dot(a, b, acc)`` as ``numpy.matmul(a, b) + acc``,
and numpy's BLAS (OpenBLAS) picks its kernel, and so its summation order,
by the matrices' shapes: the same row times the same column can round
differently in a 16- and a 32-column product. On a GPU a tile's element is
one MMA chain over the K step whatever the tile's width, so the tile shape
is a schedule choice there and the bitwise tests of tile shapes need an
interpreter dot with the same property. ``shape_independent_dot()`` patches
the interpreter's dot to sum each element's ``K`` products in order k = 0,
1, ... in the accumulator's dtype, then add the accumulator: the structure
of numpy's ``matmul(a, b) + acc``, without the shape-dependent blocking.
Bits differ from the unpatched interpreter's (the golden digests use that).
"""

from __future__ import annotations

import contextlib

import numpy as np


def _ordered_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    from triton.runtime.interpreter import TensorHandle

    dtype = d.data.dtype
    left, right = a.data.astype(dtype), b.data.astype(dtype)
    product = np.zeros(left.shape[:-1] + right.shape[-1:], dtype=dtype)
    for k in range(left.shape[-1]):
        product += left[..., :, k:k + 1] * right[..., k:k + 1, :]
    return TensorHandle(product + d.data, d.dtype.scalar)


@contextlib.contextmanager
def shape_independent_dot():
    """Within the block, the interpreter's ``tl.dot`` sums in a fixed order per element."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot
    interpreter.InterpreterBuilder.create_dot = _ordered_dot
    try:
        yield
    finally:
        interpreter.InterpreterBuilder.create_dot = original
