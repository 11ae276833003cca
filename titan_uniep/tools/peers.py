"""The peers the layer benches time beside UniEP, on the same inputs, and the
bf16 peak they are read against.

- Liger-Kernel's fused MoE (``liger_kernel.ops.fused_moe.LigerFusedMoEFunction``,
  ``pip install liger-kernel``): a Triton MoE with its own forward (routing
  metadata, gather + fc1 + SwiGLU, fc2, weighted sum) and backward. It holds
  every expert on its GPU, so it runs at EP = 1 only, and it applies the
  router scores after the experts. Its weights are laid out as one
  ``(E, 2H, D)`` gate | up tensor and ``(E, D, H)`` down weights; the benches
  build that layout once per path (a model on Liger stores its weights so),
  outside the timed calls.
- ``measured_peak_tflops``: an ``8192^3`` bf16 matmul timed in the same
  process, the peak each bench's TF/s is a share of (not a datasheet figure).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["LIGER", "liger_forward", "liger_fwd_bwd", "liger_unavailable", "measured_peak_tflops"]

LIGER = "liger_fused_moe"


def liger_unavailable(world: int, score_before: bool) -> str | None:
    """Why Liger's fused MoE cannot run this bench's layer, or None when it can."""
    if world != 1:
        return f"it holds every expert on one GPU (EP = 1), this bench runs EP = {world}"
    if score_before:
        return "it applies the router scores after the experts only"
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction  # noqa: F401
    except ImportError as error:
        return f"liger-kernel is not importable ({error}); pip install liger-kernel"
    return None


def _liger_weights(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchTitan's ``w1, w3 (E, H, D)`` and ``w2 (E, D, H)`` as Liger's
    ``gate_up (E, 2H, D)`` (gate rows first) and ``down (E, D, H)``."""
    return torch.cat([w1, w3], dim=1).contiguous(), w2.contiguous()


def liger_forward(x: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor, w3: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A callable running Liger's forward on the layer (every expert's weights)."""
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    gate_up, down = _liger_weights(w1, w2, w3)
    index = indices.to(torch.int32).contiguous()
    weights = scores.to(torch.float32).contiguous()  # fp32 router scores, as TorchTitan's router gives

    def forward() -> torch.Tensor:
        return LigerFusedMoEFunction.apply(x, gate_up, down, index, weights)

    return forward


def liger_fwd_bwd(x: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor, grad: torch.Tensor,
                  w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
                  ) -> tuple[Callable[[], None], Callable[[], dict[str, torch.Tensor]]]:
    """``(step, gradients)``: ``step()`` runs Liger's forward and its backward
    of ``grad`` (gradients of x, the scores and the weights, as training
    needs them); ``gradients()`` returns the last step's output and gradients
    in UniEP's names and layouts (``out``, ``dx``, ``dscores``, ``dw1``,
    ``dw2``, ``dw3``)."""
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    gate_up, down = (w.detach().requires_grad_() for w in _liger_weights(w1, w2, w3))
    xg = x.detach().requires_grad_()
    weights = scores.detach().to(torch.float32).requires_grad_()
    index = indices.to(torch.int32).contiguous()
    last: dict[str, torch.Tensor] = {}

    def step() -> None:
        for leaf in (xg, weights, gate_up, down):
            leaf.grad = None
        out = LigerFusedMoEFunction.apply(xg, gate_up, down, index, weights)
        out.backward(grad)
        last["out"] = out

    def gradients() -> dict[str, torch.Tensor]:
        hidden = w1.shape[1]
        return {"out": last["out"].detach(), "dx": xg.grad, "dscores": weights.grad,
                "dw1": gate_up.grad[:, :hidden], "dw2": down.grad, "dw3": gate_up.grad[:, hidden:]}

    return step, gradients


def measured_peak_tflops(device: torch.device | str = "cuda", size: int = 8192, warmup: int = 3,
                         reps: int = 10) -> float:
    """TF/s of a ``size^3`` bf16 matmul on random data, timed here (the
    median of ``reps`` calls): the peak the benches' shares are taken of."""
    from titan_uniep.timing import time_ms

    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=gen, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, generator=gen, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, warmup, reps)
    return 2 * size**3 / ms / 1e9
