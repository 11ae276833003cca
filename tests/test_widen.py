"""Widening 16-bit weight gradients to fp32 (an explicit ``wgrad_backend =
"grouped_mm"`` with fp32 master weights): ``kernels.widen`` gives the bits of
``Tensor.to(torch.float32)``. The kernel runs in Triton's interpreter here and
on a GPU (``runtime.launch.widen_to_float32``) in ``tests/gpu/test_gpu_widen.py``."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from titan_uniep.kernels.widen import widen_kernel

SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, 3.0e38]
SUBNORMAL = {torch.bfloat16: [9.2e-41, -3.0e-39], torch.float16: [6e-8, -3e-5]}


def sixteen_bit(dtype, numel, seed, *, subnormals=True, device="cpu"):
    """Random values over 12 decades, with zeros of both signs, infinities, NaN,
    the largest values and (``subnormals``) subnormal ones."""
    gen = torch.Generator().manual_seed(seed)
    t = (torch.randn(numel, generator=gen) * torch.logspace(-6, 6, numel)).to(dtype)
    specials = (SPECIALS + (SUBNORMAL[dtype] if subnormals else []))[:numel]
    t[: len(specials)] = torch.tensor(specials).to(dtype)
    return t.to(device)


@pytest.mark.skipif(not isinstance(tl.standard.cdiv, InterpretedFunction), reason="Triton imported before "
                    "TRITON_INTERPRET=1 (run in a subprocess)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widen_kernel_gives_the_casts_bits(dtype):
    numel, block = 3 * 64 + 5, 64  # a partial last block
    # The interpreter flushes bf16 subnormals (its bf16 emulation); the GPU test has them.
    src = sixteen_bit(dtype, numel, seed=numel, subnormals=dtype == torch.float16)
    dst = torch.full((numel + 7,), float("nan"))  # poisoned, and longer than numel: the mask keeps the tail
    widen_kernel[(triton.cdiv(numel, block),)](src, dst, numel, BLOCK=block)
    assert torch.equal(dst[:numel].view(torch.int32), src.to(torch.float32).view(torch.int32))
    assert dst[numel:].isnan().all()
