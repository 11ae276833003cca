"""UniEP's edge for TorchTitan 0.2.2 (TOML train configs, train-spec registry).

A train config imports this package with ``[experimental] custom_import =
"titan_uniep.torchtitan.v0_2"`` (TorchTitan imports it before it looks up the
train spec); importing it registers, through TorchTitan's own registries:

- the train specs ``deepseek_v3_uniep``, ``qwen3_uniep`` and ``llama4_uniep``:
  the base model's spec with its parallelize_fn wrapped by
  ``parallelize.wrap_parallelize_fn``;
- the bundled offline dataset (``titan_uniep.torchtitan.data``) and the extra
  model flavors of ``flavors`` (realistic MoE layer shapes).

The ``[uniep]`` section itself comes from ``[job] custom_config_module =
"titan_uniep.config"``. The worker's start-up checks that need TorchTitan are
in ``preflight`` (this edge's side of ``titan_uniep.torchtitan.preflight``).
"""

from __future__ import annotations

import dataclasses
import importlib

from torchtitan.protocols.train_spec import _extra_train_specs, register_train_spec

from titan_uniep.torchtitan.data import register_dataset
# The table lives with the launcher's checks, which read it without importing TorchTitan.
from titan_uniep.torchtitan.preflight import UNIEP_MODELS
from titan_uniep.torchtitan.v0_2.flavors import register_flavors
from titan_uniep.torchtitan.v0_2.parallelize import wrap_parallelize_fn


def _register_train_specs() -> None:
    for name, base in UNIEP_MODELS.items():
        if name in _extra_train_specs:  # imported twice (custom_import and user code)
            continue
        base_spec = importlib.import_module(f"torchtitan.models.{base}").get_train_spec()
        spec = dataclasses.replace(base_spec, parallelize_fn=wrap_parallelize_fn(base_spec.parallelize_fn))
        register_train_spec(name, spec)


register_dataset()
register_flavors()
_register_train_specs()
