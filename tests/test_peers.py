"""The benches' peer adapters on CPU: when Liger-Kernel's fused MoE is not
run and why, its weight layout against TorchTitan's, and the ``_vs_peer``
check rule. (Liger's routing kernels do not run under Triton's interpreter:
its outputs are compared with UniEP's by the benches' ``--check`` on a GPU.)"""

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
