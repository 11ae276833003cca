"""The TorchTitan hook's entry: UniEP's hook for the installed TorchTitan.

The hook lives in the installed release's edge, and this module exports its
public names (its ``__all__``):

- TorchTitan 0.2.2: ``titan_uniep.torchtitan.v0_2.parallelize``, which wraps a
  train spec's parallelize_fn, validates the job, swaps each MoE block's expert
  path for UniEP's and applies its expert-parallel plan;
- TorchTitan 0.3.0: ``titan_uniep.torchtitan.v0_3.experts``, the override of
  ``RoutedExperts`` whose ``parallelize`` shards the experts and takes the EP group.

``titan_uniep.torchtitan.edge_module()`` picks the edge, and raises naming the
installed TorchTitan and the supported ones where there is none.
"""

from __future__ import annotations

import importlib

from titan_uniep.torchtitan import edge_module

_HOOK = {"titan_uniep.torchtitan.v0_2": "parallelize", "titan_uniep.torchtitan.v0_3": "experts"}
"""Edge package -> its module that plugs UniEP into TorchTitan's parallelization."""

_edge = importlib.import_module(f"{edge_module()}.{_HOOK[edge_module()]}")

__all__ = list(_edge.__all__)
globals().update({name: getattr(_edge, name) for name in __all__})
