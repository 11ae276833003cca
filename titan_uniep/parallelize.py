"""The TorchTitan hook's entry: UniEP's parallelize for the installed TorchTitan.

The hook itself lives in the installed release's edge
(``titan_uniep.torchtitan.v0_2.parallelize`` for TorchTitan 0.2.2: it wraps a
train spec's parallelize_fn, validates the job, swaps each MoE block's expert
path for UniEP's and applies its expert-parallel plan). This module hands on
to it: it exports that module's public names (its ``__all__``), chosen by
``titan_uniep.torchtitan.edge_module()``, which raises naming the installed
TorchTitan and the supported ones where there is no edge for it.
"""

from __future__ import annotations

import importlib

from titan_uniep.torchtitan import edge_module

_edge = importlib.import_module(f"{edge_module()}.parallelize")

__all__ = list(_edge.__all__)
globals().update({name: getattr(_edge, name) for name in __all__})
