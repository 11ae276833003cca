"""What a schedule of one MoE layer's expert-parallel path takes and returns."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

__all__ = ["Routing", "ScheduleFn"]


class Routing:
    """The router's decision for this rank's ``T`` tokens.

    - ``top_scores``: ``(T, K)`` float32 gating scores.
    - ``selected_experts_indices``: ``(T, K)`` int64 global expert ids.

    A plain class on purpose, not a tuple or dataclass: FSDP2's mixed
    precision casts floating-point tensors it finds in a module's forward
    arguments (tuples, lists, dicts and dataclasses included) to the param
    dtype, and TorchTitan applies router scores in float32.
    """

    __slots__ = ("top_scores", "selected_experts_indices")

    def __init__(self, top_scores: torch.Tensor, selected_experts_indices: torch.Tensor):
        if top_scores.shape != selected_experts_indices.shape or top_scores.dim() != 2:
            raise ValueError(
                "top_scores and selected_experts_indices must both be (T, K); got "
                f"{tuple(top_scores.shape)} and {tuple(selected_experts_indices.shape)}"
            )
        self.top_scores = top_scores
        self.selected_experts_indices = selected_experts_indices


class ScheduleFn(Protocol):
    """A schedule: this rank's tokens, routing and local expert weights ->
    the combined routed-expert output of its tokens ``(T, D)``.

    The expert GEMMs run in the dtype of ``x`` and the weights (the caller
    casts them: ``titan_uniep.compute_dtype``); the output, summed over k in
    fp32, is rounded once to ``out_dtype`` (default ``x.dtype``; a TorchTitan
    edge passes the dtype its release's combine rounds to, see
    ``titan_uniep.torchtitan.layer.UniEPExperts``). The kernel schedules
    also take ``master_weights``: the fp32 weights that 16-bit w1, w2, w3 are
    casts of, which then receive the weight gradients (``titan_uniep.op``)."""

    def __call__(
        self,
        x: torch.Tensor,
        routing: Routing,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        *,
        group: dist.ProcessGroup,
        score_before_experts: bool,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor: ...
