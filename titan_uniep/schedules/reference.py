"""The reference schedule: torch collectives into UniEP's layout.

A schedule maps this rank's tokens, their routing and this rank's local
expert weights to the combined routed-expert output of its tokens:

    out[t] = sum_{k=0..K-1} combine(score[t, k], FFN_{e[t, k]}(x[t]))

with ``FFN_e(x) = w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``, and the score
applied to the FFN's input (``score_before_experts``, TorchTitan's
``(x.float() * s).to(x.dtype)``) or to its output (in fp32). The K
contributions are summed in the fixed order k = 0..K-1 in fp32.

Every schedule places rows with ``titan_uniep.layout`` and nothing else.

- ``reference``: torch collectives (NCCL on GPU, gloo on CPU) into the layout,
  one matmul per local expert, autograd through torch. Runs anywhere; the
  oracle the kernels are tested against. It synchronises with the host once
  per layer (the all-to-all split sizes), like TorchTitan's own EP.
- ``sequential`` / ``fused`` (``schedules.kernel``): UniEP's Triton kernels
  (``titan_uniep.runtime``) behind the custom op of ``titan_uniep.op``.

This module imports no Triton: a run with ``schedule = "reference"`` never
loads the kernels (or sets ``TRITON_INTERPRET``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd

from titan_uniep.layout import compute_layout, count_per_expert

from titan_uniep.schedules.interface import Routing

__all__ = ["combine_over_k", "exchange_counts", "expert_ffn", "reference_schedule"]


def combine_over_k(rows: torch.Tensor, top_scores: torch.Tensor, score_before_experts: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """Sum a token's K expert rows in the fixed order k = 0..K-1, in fp32.

    Args:
        rows: ``(T, K, D)`` expert outputs of each copy, back on its source rank.
        top_scores: ``(T, K)`` float32; applied here unless ``score_before_experts``.
    Returns:
        ``(T, D)`` in ``out_dtype``.
    """
    num_tokens, top_k, dim = rows.shape
    acc = torch.zeros(num_tokens, dim, dtype=torch.float32, device=rows.device)
    for k in range(top_k):
        row = rows[:, k].to(torch.float32)
        acc = acc + (row if score_before_experts else top_scores[:, k : k + 1].to(torch.float32) * row)
    return acc.to(out_dtype)


def exchange_counts(selected_experts_indices: torch.Tensor, num_experts: int, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather every rank's per-expert copy counts: ``(W, E) int64``."""
    counts = count_per_expert(selected_experts_indices, num_experts)
    world = dist.get_world_size(group)
    # The functional op itself (integer counts, no autograd), the same on every
    # supported torch: torch 2.13 deprecates the all_gather_tensor wrapper
    # (FutureWarning in every run's log). The selective-AC save list names
    # this op (titan_uniep.parallelize).
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(counts, world, group.group_name)
    return torch.ops._c10d_functional.wait_tensor(gathered).view(world, num_experts)


def expert_ffn(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
    """``FFN_e`` on each local expert's contiguous rows (expert-major buffer)."""
    outs = []
    for e, chunk in enumerate(torch.split(rows, rows_per_expert)):
        h = F.silu(chunk @ w1[e].transpose(0, 1)) * (chunk @ w3[e].transpose(0, 1))
        outs.append(h @ w2[e].transpose(0, 1))
    if not outs:
        return rows.new_empty(0, w2.shape[1])
    return torch.cat(outs)


def reference_schedule(
    x: torch.Tensor,
    routing: Routing,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    score_before_experts: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Dispatch, expert FFN and combine with torch collectives, in UniEP's layout.

    Args:
        x: ``(T, D)`` this rank's tokens.
        routing: the router's ``(T, K)`` scores and expert ids.
        w1, w3: ``(El, H, D)``; w2: ``(El, D, H)``: this rank's local experts.
        group: the EP process group (``W`` ranks, ``E = W * El`` experts).
        score_before_experts: see the module docstring.
        out_dtype: the output's dtype (default ``x.dtype``); the expert FFN runs in x's.
    Returns:
        ``(T, D)`` in ``out_dtype``; differentiable w.r.t. x, scores and weights.
    """
    top_scores, indices = routing.top_scores, routing.selected_experts_indices
    num_tokens, top_k = indices.shape
    num_experts = w1.shape[0] * dist.get_world_size(group)
    counts_all = exchange_counts(indices, num_experts, group)
    layout = compute_layout(indices, counts_all, dist.get_rank(group))

    # The one host sync of this schedule: all_to_all_single needs split sizes.
    world = layout.ep_size
    sizes = torch.cat([layout.send_counts, layout.recv_counts, layout.tokens_per_local_expert]).tolist()
    send_counts, recv_counts, rows_per_expert = sizes[:world], sizes[world : 2 * world], sizes[2 * world :]
    recv_rows = sum(recv_counts)

    send_rows = x[torch.div(layout.send_order, top_k, rounding_mode="floor")]
    if score_before_experts:
        send_rows = (send_rows.to(torch.float32) * top_scores.reshape(-1, 1)[layout.send_order]).to(x.dtype)
    stream = all_to_all_single_autograd(send_rows, recv_counts, send_counts, group)

    stream_slot = layout.stream_slots(recv_rows)
    slot_to_stream = torch.empty_like(stream_slot)
    slot_to_stream[stream_slot] = torch.arange(recv_rows, device=x.device)
    expert_rows = stream[slot_to_stream]  # expert-major receive buffer
    expert_out = expert_ffn(expert_rows, w1, w2, w3, rows_per_expert)

    back = all_to_all_single_autograd(expert_out[stream_slot], send_counts, recv_counts, group)
    copy_to_back = torch.empty_like(layout.send_order)
    copy_to_back[layout.send_order] = torch.arange(layout.send_order.numel(), device=x.device)
    rows = back[copy_to_back].view(num_tokens, top_k, -1)
    return combine_over_k(rows, top_scores, score_before_experts, out_dtype or x.dtype)
