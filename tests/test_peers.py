"""The benches' peer adapters on CPU: when Liger-Kernel's fused MoE is not
run and why, its weight layout against TorchTitan's, the gradients the
adapter hands back (through Liger's documented contract in plain torch:
Liger's routing kernels do not run under Triton's interpreter, so its own
outputs meet UniEP's in the benches' ``--check`` on a GPU), and the
``_vs_peer`` check rule."""

from __future__ import annotations

import sys

import pytest
import torch

from titan_uniep.accuracy import LIMITS, failures
from titan_uniep.tools import peers


def test_liger_is_not_run_where_it_cannot_serve_the_layer(monkeypatch):
    assert "EP = 2" in peers.liger_unavailable(2, score_before=False)
    assert "after the experts" in peers.liger_unavailable(1, score_before=True)
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_moe", None)  # import fails
    assert "pip install liger-kernel" in peers.liger_unavailable(1, score_before=False)


def test_liger_weight_layout_is_gate_rows_then_up_rows():
    gen = torch.Generator().manual_seed(3)
    experts, hidden, dim = 5, 7, 9
    w1, w3 = torch.randn(experts, hidden, dim, generator=gen), torch.randn(experts, hidden, dim, generator=gen)
    w2 = torch.randn(experts, dim, hidden, generator=gen)
    gate_up, down = peers._liger_weights(w1, w2, w3)
    assert gate_up.shape == (experts, 2 * hidden, dim) and gate_up.is_contiguous()
    assert torch.equal(gate_up[:, :hidden], w1) and torch.equal(gate_up[:, hidden:], w3)
    assert torch.equal(down, w2)
    # Liger's kernel reads gate row n at n and up row n at n + hidden (I_dim * stride_w_N).
    assert gate_up.stride(1) * hidden == gate_up[:, hidden:].storage_offset()


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_a_peer_beyond_the_limit_fails_the_check(direction):
    limit = LIMITS[direction]["bf16"]
    assert failures({"liger_fused_moe_out_vs_peer": 0.5 * limit["vs_peer"]}, limit) == []
    message = failures({"liger_fused_moe_dw1_vs_peer": 2 * limit["vs_peer"]}, limit)
    assert message == [f"liger_fused_moe_dw1_vs_peer: {2 * limit['vs_peer']:.3g} exceeds the limit {limit['vs_peer']}"]
    assert failures({"liger_fused_moe_out_vs_peer": float("nan")}, limit)  # NaN fails


class _LigerContract(torch.autograd.Function):
    """Liger's ``LigerFusedMoEFunction`` contract in plain torch (its routing
    kernels do not run in the interpreter): ``gate_up (E, 2I, D)`` gate rows
    first, ``down (E, D, I)``, int32 indices, ``out[t] = sum_k w[t,k] FFN(x[t])``;
    gradients of x, gate_up, down and the weights."""

    @staticmethod
    def forward(ctx, x, gate_up, down, index, weights):
        assert index.dtype == torch.int32 and gate_up.is_contiguous()
        ctx.save_for_backward(x, gate_up, down, index, weights)
        with torch.enable_grad():
            return _LigerContract._compute(x, gate_up, down, index, weights).detach()

    @staticmethod
    def _compute(x, gate_up, down, index, weights):
        hidden = gate_up.shape[1] // 2
        out = torch.zeros_like(x)
        for k in range(index.shape[1]):
            up = torch.einsum("td,thd->th", x, gate_up[index[:, k].long()])
            act = torch.nn.functional.silu(up[:, :hidden]) * up[:, hidden:]
            out = out + weights[:, k:k + 1] * torch.einsum("th,tdh->td", act, down[index[:, k].long()])
        return out

    @staticmethod
    def backward(ctx, grad):
        x, gate_up, down, index, weights = ctx.saved_tensors
        leaves = [t.detach().requires_grad_() for t in (x, gate_up, down, weights)]
        with torch.enable_grad():
            out = _LigerContract._compute(leaves[0], leaves[1], leaves[2], index, leaves[3])
        dx, dgate_up, ddown, dweights = torch.autograd.grad(out, leaves, grad)
        return dx, dgate_up, ddown, None, dweights


def test_liger_gradients_come_back_in_uniep_names_and_layouts(monkeypatch):
    """``liger_fwd_bwd`` against the float64 oracle through Liger's contract:
    a swapped gate | up, a transposed weight or a lost score gradient shows."""
    import types

    from titan_uniep.oracle import float64_moe_backward_oracle, float64_moe_oracle

    module = types.ModuleType("liger_kernel.ops.fused_moe")
    module.LigerFusedMoEFunction = _LigerContract
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_moe", module)
    gen = torch.Generator().manual_seed(11)
    tokens, dim, hidden, experts, top_k = 23, 12, 10, 5, 2
    x = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    w1, w3 = (torch.randn(experts, hidden, dim, generator=gen, dtype=torch.float64) * dim**-0.5 for _ in range(2))
    w2 = torch.randn(experts, dim, hidden, generator=gen, dtype=torch.float64) * hidden**-0.5
    scores, indices = torch.softmax(torch.randn(tokens, experts, generator=gen, dtype=torch.float64), 1).topk(top_k)
    grad = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    step, gradients = peers.liger_fwd_bwd(x, scores, indices, grad, w1, w2, w3)
    step()
    got = gradients()
    torch.testing.assert_close(got["out"], float64_moe_oracle(x, scores, indices, w1, w2, w3,
                                                               score_before_experts=False))
    dx, dscores, dw1, dw2, dw3 = float64_moe_backward_oracle(x, scores, indices, grad, w1, w2, w3,
                                                            score_before_experts=False)
    for name, want in (("dx", dx), ("dscores", dscores), ("dw1", dw1), ("dw2", dw2), ("dw3", dw3)):
        torch.testing.assert_close(got[name].double(), want, msg=name)
