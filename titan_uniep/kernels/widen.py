"""widen: a 16-bit tensor's values in fp32 (exact), with vector loads and stores.

With an explicit ``wgrad_backend = "grouped_mm"`` and fp32 master weights,
``torch._grouped_mm`` writes each weight gradient in bf16 (its output takes
its operands' dtype) and ``runtime.launch.widen_to_float32`` widens it, as
autograd's ``Tensor.to`` backward does in TorchTitan's experts (the default
Triton kernel writes fp32 itself). torch's copy runs a bf16 -> fp32 cast
element by element (``direct_copy_kernel_cuda``'s unrolled loop, about half
the bandwidth of its vectorized fp32 -> bf16 cast on an H200: 0.61 against
0.32 ms for a 128 x 768 x 2048 weight); this kernel reads and writes whole
vectors (0.46 ms there). Widening is exact, so the bits are the cast's.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def widen_kernel(src, dst, numel, BLOCK: tl.constexpr):
    """``dst[i] = float32(src[i])`` for the ``BLOCK`` elements of this program."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    tl.store(dst + offs, tl.load(src + offs, mask=mask).to(tl.float32), mask=mask)
