"""Ordered pure-PyTorch oracles of UniEP's forward and backward (used by
tests and the benchmarks' ``--check``).

- ``float64_moe_oracle``: the math itself, in float64, straight from the
  global expert weights; no layout, no exchange. The oracle for "close".
- ``float64_moe_backward_oracle``: its gradients, in float64, expert by
  expert (one expert's weights in float64 at a time, so that it runs at
  DeepSeek sizes on a subsample of tokens).
- ``layout_oracle_forward``: a simulated world that places every copy with
  ``titan_uniep.layout`` and rounds exactly where the kernels round
  (activation dtype after each GEMM and after silu, fp32 accumulation, top-k
  sum in fp32 in order k = 0..K-1). Equal to the kernels up to fp32
  accumulation order.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .layout import compute_layout, count_per_expert

__all__ = ["float64_moe_backward_oracle", "float64_moe_oracle", "layout_oracle_forward"]


def float64_moe_oracle(
    x: torch.Tensor,
    top_scores: torch.Tensor,
    selected_experts_indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    score_before_experts: bool,
) -> torch.Tensor:
    """``(T, D) float64``: ``out[t] = sum_k FFN_e(x[t] * s)`` (score before) or
    ``sum_k s * FFN_e(x[t])`` (after), ``e = indices[t, k]``, ``s = score[t, k]``,
    ``FFN_e(v) = w2[e] (silu(w1[e] v) * (w3[e] v))``. Weights are global:
    ``w1``/``w3`` ``(E, H, D)``, ``w2`` ``(E, D, H)``."""
    x64 = x.to(torch.float64)
    out = torch.zeros_like(x64)
    for e in torch.unique(selected_experts_indices).tolist():
        token, choice = (selected_experts_indices == e).nonzero(as_tuple=True)
        score = top_scores[token, choice].to(torch.float64)[:, None]
        rows = x64[token] * score if score_before_experts else x64[token]
        gate = rows @ w1[e].to(torch.float64).T
        hidden = gate * torch.sigmoid(gate) * (rows @ w3[e].to(torch.float64).T)
        y = hidden @ w2[e].to(torch.float64).T
        out.index_add_(0, token, y if score_before_experts else y * score)
    return out


def float64_moe_backward_oracle(
    x: torch.Tensor,
    top_scores: torch.Tensor,
    selected_experts_indices: torch.Tensor,
    grad_out: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    score_before_experts: bool,
    experts: Sequence[int] | None = None,
    weight_grads: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``float64_moe_oracle`` for the output gradient ``grad_out``
    ``(T, D)``, in float64: ``dx (T, D)``, ``dscores (T, K)`` and ``dw1``,
    ``dw2``, ``dw3`` of the experts in ``experts`` (default all; global ids)
    stacked in that order (``(len(experts), H, D)``, ``(.., D, H)``,
    ``(.., H, D)``; None without ``weight_grads``). Only the copies routed to
    ``experts`` contribute, to ``dx`` and ``dscores`` too: pass every expert
    for those."""
    x64, g64 = x.to(torch.float64), grad_out.to(torch.float64)
    experts = list(range(w1.shape[0])) if experts is None else list(experts)
    dx = torch.zeros_like(x64)
    dscores = torch.zeros(top_scores.shape, dtype=torch.float64, device=x.device)
    dws = [torch.zeros(len(experts), *w.shape[1:], dtype=torch.float64, device=x.device) if weight_grads else None
           for w in (w1, w2, w3)]
    for i, e in enumerate(experts):
        token, choice = (selected_experts_indices == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        we1, we2, we3 = (w[e].to(torch.float64) for w in (w1, w2, w3))
        score = top_scores[token, choice].to(torch.float64)[:, None]
        rows = x64[token] * score if score_before_experts else x64[token]
        gate, up = rows @ we1.T, rows @ we3.T
        sig = torch.sigmoid(gate)
        act = gate * sig
        hidden = act * up
        grad_y = g64[token] if score_before_experts else g64[token] * score
        grad_hidden = grad_y @ we2
        grad_gate = grad_hidden * up * sig * (1 + gate * (1 - sig))
        grad_up = grad_hidden * act
        if weight_grads:
            dws[0][i], dws[1][i], dws[2][i] = grad_gate.T @ rows, grad_y.T @ hidden, grad_up.T @ rows
        grad_rows = grad_gate @ we1 + grad_up @ we3
        if score_before_experts:
            dx.index_add_(0, token, grad_rows * score)
            dscores[token, choice] = (grad_rows * x64[token]).sum(1)
        else:
            dx.index_add_(0, token, grad_rows)
            dscores[token, choice] = (g64[token] * (hidden @ we2.T)).sum(1)
    return dx, dscores, dws[0], dws[1], dws[2]


def layout_oracle_forward(
    xs: Sequence[torch.Tensor],
    scores: Sequence[torch.Tensor],
    indices: Sequence[torch.Tensor],
    w1s: Sequence[torch.Tensor],
    w2s: Sequence[torch.Tensor],
    w3s: Sequence[torch.Tensor],
    *,
    score_before_experts: bool,
) -> list[torch.Tensor]:
    """The kernels' computation in torch for a simulated world of ``len(xs)``
    ranks (same arguments as ``fused.simulated_moe_forward``)."""
    world = len(xs)
    num_local = w1s[0].shape[0]
    num_experts = num_local * world
    dtype, dim = xs[0].dtype, xs[0].shape[1]
    counts_all = torch.stack([count_per_expert(idx.cpu(), num_experts) for idx in indices]).to(xs[0].device)
    layouts = [compute_layout(indices[r], counts_all, r) for r in range(world)]

    # Receive side: every copy's row and score at its slot.
    received = []
    for r in range(world):
        rows = int(layouts[r].expert_offsets[-1])
        recv_x = torch.zeros(rows, dim, dtype=dtype, device=xs[0].device)
        recv_score = torch.zeros(rows, dtype=torch.float32, device=xs[0].device)
        recv_from = torch.zeros(rows, 3, dtype=torch.int64, device=xs[0].device)  # (source, t, k)
        for s in range(world):
            token, choice = (layouts[s].dest_rank == r).nonzero(as_tuple=True)
            slot = layouts[s].dest_slot[token, choice]
            recv_x[slot] = xs[s][token]
            recv_score[slot] = scores[s][token, choice].to(torch.float32)
            recv_from[slot] = torch.stack([torch.full_like(token, s), token, choice], 1)
        received.append((recv_x, recv_score, recv_from))

    # Experts, rounding where the kernels round.
    returned = [torch.zeros(x.shape[0], indices[0].shape[1], dim, dtype=dtype, device=x.device) for x in xs]
    for r in range(world):
        recv_x, recv_score, recv_from = received[r]
        offsets = layouts[r].expert_offsets.tolist()
        for e in range(num_local):
            lo, hi = offsets[e], offsets[e + 1]
            a = recv_x[lo:hi]
            if score_before_experts:
                a = (a.float() * recv_score[lo:hi, None]).to(dtype)
            gate = (a.float() @ w1s[r][e].float().T).to(dtype).float()
            up = (a.float() @ w3s[r][e].float().T).to(dtype).float()
            act = (gate / (1.0 + torch.exp(-gate))).to(dtype).float()
            h = (act * up).to(dtype)
            y = (h.float() @ w2s[r][e].float().T).to(dtype)
            src = recv_from[lo:hi]
            for s in range(world):
                mine = src[:, 0] == s
                returned[s][src[mine, 1], src[mine, 2]] = y[mine]

    outs = []
    for s in range(world):
        acc = torch.zeros(xs[s].shape[0], dim, dtype=torch.float32, device=xs[s].device)
        for k in range(indices[s].shape[1]):
            y = returned[s][:, k].float()
            acc = acc + (y if score_before_experts else scores[s][:, k, None].float() * y)
        outs.append(acc.to(dtype))
    return outs
