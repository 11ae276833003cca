"""``runtime.launch.widen_to_float32`` on ONE GPU: ``kernels.widen`` gives the
bits of ``Tensor.to(torch.float32)`` for bf16 and fp16, subnormals included,
at sizes that end in a partial block, and of strided tensors.

Run on the GPU machine: ``python -m pytest tests/gpu/test_gpu_widen.py``.
"""

import pytest
import torch

from titan_uniep.runtime.launch import widen_to_float32

from test_widen import sixteen_bit

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 8191, 8192 * 37 + 13, 24 * 1024 * 1024 + 1])
def test_widen_gives_the_casts_bits(dtype, numel):
    src = sixteen_bit(dtype, numel, seed=numel, device="cuda")
    ref = src.to(torch.float32)
    out = widen_to_float32(src.view(-1, 1) if numel % 2 else src)
    assert out.dtype == torch.float32 and out.shape == (src.view(-1, 1) if numel % 2 else src).shape
    assert torch.equal(out.view(-1).view(torch.int32), ref.view(torch.int32))


def test_widen_of_a_strided_tensor():
    src = sixteen_bit(torch.bfloat16, 4096, seed=1, device="cuda").view(64, 64).t()
    assert torch.equal(widen_to_float32(src).view(torch.int32), src.float().view(torch.int32))
