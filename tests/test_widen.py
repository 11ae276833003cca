"""The weights' gradient path back to fp32 master weights: ``uniep::widen``
(``kernels.widen`` on a GPU) gives the bits of ``Tensor.to(torch.float32)``,
and ``op.to_compute`` is ``Tensor.to`` with that backward. The kernel runs in
Triton's interpreter here and on a GPU in ``tests/gpu/test_gpu_widen.py``."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from titan_uniep.compute_dtype import cast_to_compute
from titan_uniep.kernels.widen import widen_kernel
from titan_uniep.op import to_compute

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


def test_to_compute_is_tensor_to_with_the_same_gradient():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(3, 8, 4, generator=gen, requires_grad=True)
    upstream = torch.randn(3, 8, 4, generator=gen)
    mine = to_compute(w, torch.bfloat16)
    assert mine.dtype == torch.bfloat16 and torch.equal(mine, w.detach().to(torch.bfloat16))
    (mine.float() * upstream).sum().backward()
    ours, w.grad = w.grad, None
    (w.to(torch.bfloat16).float() * upstream).sum().backward()
    assert ours.dtype == torch.float32 and torch.equal(ours, w.grad)
    bf16 = w.detach().bfloat16()
    assert to_compute(bf16, torch.bfloat16) is bf16  # no cast where the weight already is


def test_cast_to_compute_uses_the_weight_cast_for_weights_only():
    seen = []

    def cast(w, dtype):
        seen.append(w.shape)
        return w.to(dtype)

    x, w1, w2 = torch.randn(5, 4), torch.randn(2, 3, 4), torch.randn(2, 4, 3).bfloat16()
    out = cast_to_compute(torch.bfloat16, x, w1, w2, weight_cast=cast)
    assert [t.dtype for t in out] == [torch.bfloat16] * 3
    assert seen == [w1.shape]  # x goes through Tensor.to, the bf16 weight is not cast
