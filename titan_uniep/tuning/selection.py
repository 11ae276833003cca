"""Which ``LayerParams`` a UniEP workspace is built with: the ``[uniep] tuning`` policy.

- ``"off"``: the shipped defaults (``params.default_params``).
- ``"cached"``: the tuned entry of the layer's key in the cache file
  (``tuning.cache``); without one, the default, with one warning per layer
  shape saying why (no cache file, no entry, or an entry of another GPU / EP
  size / kernel version, named). A file that cannot be read or is not a
  tuning cache is an error at start-up (``titan_uniep.torchtitan.preflight``), before
  the model is built.
- ``"search"``: at start-up, the measured search (``tuning.search``) of
  every MoE shape of the run, on the EP group, merged into the cache file
  (by global rank 0); then as ``"cached"``. GPU only.

The parallelize hook registers one ``TuningPolicy`` per EP group
(``set_policy``); ``op.workspace_for`` asks ``select_params`` when it builds a
workspace (once per group, direction and layer shape), so a lookup never
runs per step. Every rank of the group must build with the same point (its
block size shapes the layout every peer writes into): ``select_params``
checks that they agree and raises otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import TUNING_MODES
from ..params import LayerParams
from .cache import CacheEntry, CacheKey, default_cache_path, load, lookup, merge, save

__all__ = ["TuningPolicy", "configure_tuning", "policy_for", "select_params", "set_policy"]

logger = logging.getLogger(__name__)

# EP group name -> its policy, set once at start-up by the parallelize hook.
_policies: dict[str, "TuningPolicy"] = {}


@dataclass
class TuningPolicy:
    """One EP group's ``[uniep] tuning`` mode, its cache file and the entries read from it."""

    mode: str
    cache_path: str
    entries: list[CacheEntry] = field(default_factory=list)
    warned: set[CacheKey] = field(default_factory=set)

    @classmethod
    def from_config(cls, mode: str, cache_path: str = "") -> "TuningPolicy":
        """``cache_path`` empty: ``cache.default_cache_path()``. Reads the file
        for ``"cached"`` and ``"search"``: a missing file has no entries (every
        shape runs the default, with a warning); a file that cannot be read or
        is not a tuning cache raises ValueError naming ``[uniep] tuning_cache``."""
        if mode not in TUNING_MODES:
            raise ValueError(f"[uniep] tuning = {mode!r}: use one of {', '.join(map(repr, TUNING_MODES))}")
        path = cache_path or default_cache_path()
        policy = cls(mode=mode, cache_path=path)
        if mode == "off":
            return policy
        try:
            policy.entries = load(path)
        except ValueError as err:
            raise ValueError(
                f"[uniep] tuning_cache: {err}. Set [uniep] tuning_cache to a file written by "
                "`python -m titan_uniep.tools.tune` (or to a path that does not exist yet), or tuning = \"off\"."
            ) from None
        return policy

    def params_for(self, key: CacheKey, direction: str) -> LayerParams | None:
        """The tuned point of ``key`` (None: the default), warning once per shape when there is none."""
        if self.mode == "off":
            return None
        params, reason = lookup(self.entries, key, direction)
        shape_key = dataclasses.replace(key, kernel_version="")
        if params is None and shape_key not in self.warned:
            self.warned.add(shape_key)
            if not self.entries and not os.path.exists(self.cache_path):
                reason = (f"no tuned entry for {key.describe()}: the tuning cache does not exist (write it with "
                          "`python -m titan_uniep.tools.tune --config <this config>`, torchrun over the EP size)")
            logger.warning("UniEP tuning (%s, %s): %s; using the default parameters", self.mode, self.cache_path,
                           reason)
        elif params is not None:
            logger.info("UniEP tuning: %s %s: %s", key.describe(), direction, reason)
        return params

    def add(self, new: list[CacheEntry], *, write: bool) -> None:
        """Use ``new`` entries (from a search) and, if ``write``, merge them into the cache file."""
        self.entries = save(self.cache_path, new) if write else merge(self.entries, new)


def configure_tuning(group: dist.ProcessGroup, mode: str, cache_path: str, *, moe_modules=(), num_tokens: int = 0,
                     dtype: torch.dtype = torch.bfloat16, weight_grad_dtype: torch.dtype | None = None
                     ) -> TuningPolicy:
    """Start-up (every rank of ``group``): read the cache, run the measured
    search of every distinct MoE shape of ``moe_modules`` (TorchTitan ``MoE``
    blocks: ``experts.w1`` ``(E, H, D)``, ``router.top_k``) at ``num_tokens``
    tokens per rank, ``dtype`` and the weight gradients in
    ``weight_grad_dtype`` (None: ``dtype``) for ``mode = "search"``, and
    register the policy for ``group``'s workspaces."""
    policy = TuningPolicy.from_config(mode, cache_path)
    if mode == "search":
        # Here, not at the top: the search loads the runtime and its kernels, which the start-up
        # checks (torchtitan.preflight) that import this module for TuningPolicy must not.
        from .search import MoELayer, SearchOptions, search_layer

        layers = {}
        for moe in moe_modules:
            num_experts, hidden, dim = moe.experts.w1.shape
            layer = MoELayer(f"T{num_tokens} D{dim} H{hidden} E{num_experts} K{moe.router.top_k}", num_tokens, dim,
                             hidden, num_experts, moe.router.top_k, moe.score_before_experts, dtype,
                             weight_grad_dtype)
            layers.setdefault(layer.name, layer)
        results = [search_layer(group, layer, SearchOptions()) for layer in layers.values()]
        broken = [v for res in results for v in res.violations]
        if broken:
            raise RuntimeError("UniEP tuning search: tuned points broke the bitwise contract (a kernel bug; "
                               "nothing was cached): " + "; ".join(broken) + ". Set [uniep] tuning = \"off\".")
        policy.add([res.entry for res in results if res.entry is not None], write=dist.get_rank() == 0)
    set_policy(group, policy)
    return policy


def set_policy(group: dist.ProcessGroup, policy: TuningPolicy) -> None:
    """Register ``policy`` for the workspaces of ``group`` (every rank, before the first MoE call)."""
    _policies[group.group_name] = policy


def policy_for(group_name: str) -> TuningPolicy | None:
    return _policies.get(group_name)


def select_params(group: dist.ProcessGroup, *, num_tokens: int, dim: int, hidden: int, num_experts: int,
                  top_k: int, score_before_experts: bool, dtype: torch.dtype, device: torch.device,
                  backward: bool) -> LayerParams | None:
    """The point a workspace of this layer is built with: the group's tuned
    entry, or None (the default) without a policy, with ``tuning = "off"`` or
    without an entry. Collective over ``group`` when a policy is set."""
    policy = _policies.get(group.group_name)
    if policy is None or policy.mode == "off":
        return None
    key = CacheKey.for_layer(gpu=torch.cuda.get_device_name(device), ep_size=dist.get_world_size(group),
                             dtype=dtype, num_tokens=num_tokens, dim=dim, hidden=hidden, num_experts=num_experts,
                             top_k=top_k, score_before_experts=score_before_experts)
    params = policy.params_for(key, "backward" if backward else "forward")
    check_agreement(group, params, device, policy.cache_path)
    return params


def params_digest(params: LayerParams | None) -> int:
    """A 60-bit digest of a point (0 for the default), the same in every process."""
    if params is None:
        return 0
    text = json.dumps(dataclasses.asdict(params), sort_keys=True)
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16) + 1


def check_agreement(group: dist.ProcessGroup, params: LayerParams | None, device: torch.device,
                    cache_path: str) -> None:
    """Raise RuntimeError on every rank if the ranks of ``group`` chose different points."""
    digest = params_digest(params)
    bounds = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    if int(bounds[0]) != -int(bounds[1]):
        raise RuntimeError(
            f"UniEP tuning: the ranks of EP group {group.group_name!r} chose different parameter points "
            f"(this rank: {'the default' if params is None else 'a tuned entry'} from {cache_path}). "
            "Give every rank the same [uniep] tuning_cache file, or set [uniep] tuning = \"off\"."
        )
