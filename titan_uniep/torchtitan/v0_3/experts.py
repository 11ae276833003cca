"""UniEP's routed experts for TorchTitan 0.3.0: an override of ``RoutedExperts``.

TorchTitan 0.3.0's ``MoE`` holds ``RoutedExperts``: a token dispatcher
(dispatch, then combine with the router scores) around ``GroupedExperts``
(``inner_experts``: the expert weights ``w1_EFD``, ``w2_EDF``, ``w3_EFD``).
``UniEPRoutedExperts`` keeps ``inner_experts`` (the very parameters, FQNs,
initialisation and EP sharding of its ``sharding_config``: checkpoints
interchange with the baseline) and replaces the dispatcher and the grouped
GEMMs with one UniEP schedule (``torch.ops.uniep.moe_experts`` for the kernel
schedules), which dispatches, computes and combines. It builds no token
dispatcher; the kernel schedules have no host sync, so they run under
TorchTitan's CUDA graphs (the reference schedule syncs, see ``trainer.validate``).

``uniep_routed_experts`` is the ``@override(target=RoutedExperts.Config)``
factory; ``apply_uniep`` applies it to every routed-experts node of a model
config (or, with ``enable = false``, puts TorchTitan's back), which the
UniEP trainer config does whenever it is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.config import derive, override
from torchtitan.models.common.moe import RoutedExperts

from titan_uniep.compute_dtype import resolve
from titan_uniep.config import UniEP
from titan_uniep.schedules import Routing
from titan_uniep.torchtitan.ep_group import one_rank_group
from titan_uniep.torchtitan.layer import UniEPExperts

__all__ = ["UniEPRoutedExperts", "apply_uniep", "uniep_routed_experts"]


class UniEPRoutedExperts(UniEPExperts, RoutedExperts):
    """``RoutedExperts`` whose dispatch, expert FFN and combine run as one UniEP schedule.

    ``forward`` takes what ``MoE`` hands ``RoutedExperts`` (local tensors inside
    its ``local_map`` region): tokens ``(B, L, D)``, the router's top-k scores
    ``(B, L, K)`` float32 and expert ids ``(B, L, K)`` int64 (the per-expert
    counts are not needed: UniEP's layout counts on the device), and returns the
    combined routed output ``(B, L, D)`` in the tokens' dtype. The expert GEMMs
    run in ``[uniep] compute_dtype`` (``"auto"``: bf16, as TorchTitan 0.3.0's
    grouped experts always compute), accumulate in fp32, and the scores weigh
    the expert outputs after the experts, summed over k in fp32 in a fixed
    order.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        uniep: UniEP = field(default_factory=UniEP)
        """The ``[uniep]`` options this layer runs with (``schedule``, ``compute_dtype``, ...)."""

        replaced_dispatcher: tuple = ()
        """TorchTitan's token-dispatcher config this node replaced, kept for ``enable = false``.
        A tuple because config traversal does not enter one: TorchTitan's checks of
        the dispatchers that will run (CUDA graphs, EP capacity) do not see it."""

    def __init__(self, config: Config):
        nn.Module.__init__(self)  # not RoutedExperts.__init__: it would build the token dispatcher
        self.inner_experts = config.inner_experts.build()
        if config.uniep.schedule != "reference":
            import titan_uniep.op  # noqa: F401  (registers torch.ops.uniep.moe_experts, for the SAC save list)
        # TorchTitan 0.3.0's grouped experts cast their GEMM operands to bf16
        # (models/common/moe.py, GroupedExperts.forward) whatever the parameters' dtype.
        self.configure(schedule=config.uniep.schedule, score_before_experts=False,
                       compute_dtype=resolve(config.uniep.compute_dtype, framework_casts_to_bf16=True),
                       layer_name="routed_experts")

    def _local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        experts = self.inner_experts
        weights = (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD)
        # Sharded on the EP mesh (dim 0): the local shard is exactly this rank's experts.
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in weights)

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.size(-1)
        expert_ids = topk_expert_ids_BLK.reshape(B * L, K)
        if self.test_hooks is not None and self.steps is not None:
            expert_ids, _ = self.test_hooks.override_routing(self.steps.step, expert_ids,
                                                             num_local_tokens_per_expert_E)
        routing = Routing(topk_scores_BLK.reshape(B * L, K), expert_ids)
        out = self.run_uniep(x_BLD.reshape(B * L, D), routing, *self._local_weights())
        return out.view(B, L, D)

    def parallelize(self, parallel_dims) -> None:
        """Shard the expert weights as TorchTitan does (``inner_experts``' sharding
        config: dim 0 on the EP mesh) and take the EP group; at EP = 1 (no EP mesh)
        every rank runs all experts on its own tokens, in a one-rank group."""
        # Module.parallelize, not RoutedExperts.parallelize: there is no dispatcher to wire.
        super(RoutedExperts, self).parallelize(parallel_dims)
        ep_mesh = parallel_dims.get_optional_mesh("ep")
        self.ep_group = ep_mesh.get_group() if ep_mesh is not None else one_rank_group()


@override(target=RoutedExperts.Config, description="UniEP: dispatch, expert FFN and combine as one schedule")
def uniep_routed_experts(cfg: RoutedExperts.Config, **options) -> UniEPRoutedExperts.Config:
    """``cfg`` as UniEP's routed experts with the ``[uniep]`` ``options``
    (``UniEP``'s fields, e.g. ``schedule="fused"``); a node that already is
    UniEP's gets the new options."""
    if isinstance(cfg, UniEPRoutedExperts.Config):
        return dataclasses.replace(cfg, uniep=UniEP(**options))
    return derive(cfg, UniEPRoutedExperts.Config, token_dispatcher=None, uniep=UniEP(**options),
                  replaced_dispatcher=(cfg.token_dispatcher,))


def apply_uniep(model_config, options: UniEP) -> int:
    """Make every routed-experts node of ``model_config`` (in place) UniEP's with
    ``options`` if ``options.enable``, else TorchTitan's own again; return how
    many nodes there are."""
    nodes = list(model_config.traverse(RoutedExperts.Config))
    for _fqn, cfg, parent, attr in nodes:
        if options.enable:
            new = uniep_routed_experts(cfg, **dataclasses.asdict(options))
        elif isinstance(cfg, UniEPRoutedExperts.Config):
            new = derive(cfg, RoutedExperts.Config, token_dispatcher=cfg.replaced_dispatcher[0])
        else:
            continue
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return len(nodes)
