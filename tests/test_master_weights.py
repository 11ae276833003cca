"""``compute_dtype.master_weights`` and ``cast_to_compute``: which expert
weights the kernel schedules get as detached 16-bit casts with their fp32
masters (the op's backward writes the masters' gradients in fp32), and where
autograd's ``Tensor.to`` casts instead. The op with master weights:
``tests/test_op.py`` (interpreter) and ``tests/gpu/``."""

from __future__ import annotations

import torch

from titan_uniep.compute_dtype import cast_to_compute, master_weights


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
