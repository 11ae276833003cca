"""UniEP's MoE modules: TorchTitan's MoE with the expert-parallel path swapped.

``UniEPMoE`` keeps TorchTitan's router, shared experts, load-balancing buffers
(``expert_bias``, ``tokens_per_expert``) and every parameter FQN; only the
routed-expert path changes. Instead of TorchTitan's reorder -> all-to-all ->
permute/pad -> grouped GEMM -> unpermute -> all-to-all -> unsort, the experts
module receives the router's decision and runs one UniEP schedule
(``titan_uniep.schedules``) that dispatches, computes and combines.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.moe.moe import GroupedExperts, MoE

from titan_uniep.schedules import Routing
from titan_uniep.torchtitan.layer import UniEPExperts

__all__ = ["UniEPGroupedExperts", "UniEPMoE"]


class UniEPGroupedExperts(UniEPExperts, GroupedExperts):
    """TorchTitan's GroupedExperts (same w1/w2/w3, same FQNs) run by a UniEP schedule.

    ``forward(x, routing)`` takes this rank's ``(T, D)`` tokens and the
    router's decision and returns their combined routed-expert output
    ``(T, D)`` in x's dtype: dispatch, expert FFN and combine all happen
    inside (``UniEPExperts.run_uniep``), with the GEMMs in ``compute_dtype``
    (``titan_uniep.compute_dtype``: None follows x, or autocast where it is
    on). The EP group, schedule and compute dtype are set by the parallelize
    hook (``parallelize.py``).
    """

    # TorchTitan 0.2.2's MoE.forward combines with torch.bmm: under AMP in bf16.
    combine_follows_autocast = True

    def _local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if isinstance(self.w1, DTensor):
            # Expert weights are Shard(0) on the EP mesh: the local shard is
            # exactly this rank's experts, as in TorchTitan's GroupedExperts.
            return self.w1.to_local(), self.w2.to_local(), self.w3.to_local()
        return self.w1, self.w2, self.w3

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:  # type: ignore[override]
        return self.run_uniep(x, routing, *self._local_weights())


class UniEPMoE(MoE):
    """TorchTitan's MoE whose routed experts run through UniEP.

    Same submodules, parameters and buffers as ``MoE`` (the parallelize hook
    swaps the class of an existing instance); the forward differs only in
    handing the router's decision to the experts instead of reordering tokens
    itself (and, only where ``titan_uniep.testing`` hooks are set, in letting
    them override that decision).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)
        hooks, steps = self.experts.test_hooks, self.experts.steps
        if hooks is not None and steps is not None:
            selected_experts_indices, num_tokens_per_expert = hooks.override_routing(
                steps.step, selected_experts_indices, num_tokens_per_expert
            )
        # As TorchTitan's MoE: feeds the expert-bias update of the
        # load-balancing optimizer hook (and expert-usage metrics).
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)

        routed = self.experts(x, Routing(top_scores, selected_experts_indices))
        if self.shared_experts is None:
            return routed.reshape(bs, slen, dim)
        return (self.shared_experts(x) + routed).reshape(bs, slen, dim)
