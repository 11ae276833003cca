"""Widening 16-bit weight gradients to fp32 (an explicit ``wgrad_backend =
"grouped_mm"`` with fp32 master weights): ``kernels.widen`` gives the bits of
``Tensor.to(torch.float32)``. The kernel runs in Triton's interpreter here and
on a GPU (``runtime.launch.widen_to_float32``) in ``tests/gpu/test_gpu_widen.py``.
Also ``compute_dtype.master_weights``: which weights the kernels' backward
gives fp32 gradients itself."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from titan_uniep.compute_dtype import cast_to_compute, master_weights
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


def test_fp32_weights_cast_to_16_bits_are_their_casts_masters():
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(3, 8, 4, generator=gen, requires_grad=True) for _ in range(3)]
    for dtype in (torch.bfloat16, torch.float16):
        casts, masters = master_weights(dtype, *weights)
        assert masters is not None and all(m is w for m, w in zip(masters, weights))
        for c, w in zip(casts, weights):
            # Detached: autograd does not differentiate the cast, the op gives the master its gradient.
            assert c.dtype == dtype and not c.requires_grad and torch.equal(c, w.detach().to(dtype))


def test_no_masters_where_no_fp32_weight_is_cast_to_16_bits():
    gen = torch.Generator().manual_seed(6)
    fp32 = [torch.randn(2, 4, 4, generator=gen, requires_grad=True) for _ in range(3)]
    bf16 = [w.detach().bfloat16().requires_grad_() for w in fp32]
    casts, masters = master_weights(torch.float32, *fp32)  # fp32 compute: the weights themselves
    assert masters is None and all(c is w for c, w in zip(casts, fp32))
    casts, masters = master_weights(torch.bfloat16, *bf16)  # FSDP's bf16 weights: no copy
    assert masters is None and all(c is w for c, w in zip(casts, bf16))
    casts, masters = master_weights(torch.float32, *bf16)  # explicit fp32 compute of bf16 weights: autograd's cast
    assert masters is None and all(c.dtype == torch.float32 and c.requires_grad for c in casts)


def test_cast_to_compute_copies_only_what_is_not_in_the_dtype():
    x, w1, w2 = torch.randn(5, 4), torch.randn(2, 3, 4), torch.randn(2, 4, 3).bfloat16()
    out = cast_to_compute(torch.bfloat16, x, w1, w2)
    assert [t.dtype for t in out] == [torch.bfloat16] * 3
    assert out[2] is w2 and torch.equal(out[1], w1.bfloat16())
