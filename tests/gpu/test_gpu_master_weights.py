"""fp32 master weights on ONE GPU: bf16 casts run the kernels and the fp32
weights receive the weight gradients (``runtime.backward``'s
``weight_grad_dtype``), in simulated worlds of 1 and 2 ranks, bf16:

- the fp32 gradients are the bf16 ones before their rounding: rounded to
  bf16 they are the bits of the Triton kernel's bf16 gradients; most of them
  are not bf16 values; dx and dscores do not change; fused == sequential;
- an explicit ``wgrad_backend = "grouped_mm"`` widens torch's bf16 output
  (the bits of ``Tensor.float()``).

The tuner's points in this mode: ``test_gpu_schedule_bits.py``; the op with
masters, compiled and without host syncs: ``op_worker.py``.
Run on the GPU machine: ``python -m pytest tests/gpu/test_gpu_master_weights.py``.
"""

import pytest
import torch

from titan_uniep.params import default_params

import worlds
from .test_gpu_schedule_bits import NAMES, run_simulated

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

# (D, H, E, K), tokens per rank: dims no powers of two, odd token counts, skewed routing at W = 2.
CASES = {1: ((576, 744, 20, 4), [301]), 2: ((1000, 1440, 12, 3), [257, 131])}


def world(w_size: int):
    (dim, hidden, experts, top_k), tokens = CASES[w_size]
    return worlds.make_world(w_size, experts, top_k, tokens, seed=77 + w_size, dim=dim, hidden=hidden,
                             force=0 if w_size == 2 else None, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("w_size", [1, 2])
def test_fp32_weight_gradients_are_the_bf16_ones_before_rounding(w_size):
    w = world(w_size)
    triton = default_params(w_size, hidden=w["w1"].shape[1]).replace(wgrad_backend="triton")
    fp32 = {s: run_simulated(w, triton, False, s, torch.float32) for s in ("sequential", "fused")}
    bf16 = run_simulated(w, triton, False, "fused")
    for name in fp32["fused"]:
        assert torch.equal(fp32["sequential"][name], fp32["fused"][name]), f"{name}: fused differs"
    for r in range(w_size):
        for name in NAMES:
            mine, ref = fp32["fused"][f"{name}.r{r}"], bf16[f"{name}.r{r}"]
            if not name.startswith("dw"):
                assert torch.equal(mine, ref), f"{name}.r{r} changed with fp32 weight gradients"
                continue
            assert mine.dtype == torch.float32 and ref.dtype == torch.bfloat16
            assert torch.equal(mine.bfloat16(), ref), f"{name}.r{r}: rounded, not the bf16 gradient"
            assert (mine != mine.bfloat16().float()).float().mean() > 0.9, f"{name}.r{r}: rounded to bf16"


def test_explicit_grouped_mm_widens_its_bf16_weight_gradients():
    w = world(1)
    grouped = default_params(1, hidden=w["w1"].shape[1]).replace(wgrad_backend="grouped_mm")
    fp32 = run_simulated(w, grouped, False, "fused", torch.float32)
    bf16 = run_simulated(w, grouped, False, "fused")
    for name in ("dw1", "dw2", "dw3"):
        mine, ref = fp32[f"{name}.r0"], bf16[f"{name}.r0"]
        assert mine.dtype == torch.float32 and torch.equal(mine, ref.float()), name
