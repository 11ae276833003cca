"""titan_uniep: UniEP expert parallelism for TorchTitan 0.2.2.

Importing the package (``[experimental] custom_import = "titan_uniep"`` in a
train config) registers, through TorchTitan's own registries:

- the train specs ``deepseek_v3_uniep``, ``qwen3_uniep`` and ``llama4_uniep``:
  the base model's spec with its parallelize_fn wrapped by
  ``titan_uniep.parallelize.wrap_parallelize_fn``;
- the bundled offline dataset (``titan_uniep.data``) and the extra model
  flavors of ``titan_uniep.flavors`` (realistic MoE layer shapes).

The ``[uniep]`` section itself comes from ``[job] custom_config_module =
"titan_uniep.config"``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata

__version__ = "0.1.0"

#: Base TorchTitan models that have UniEP variants: spec name -> base name.
UNIEP_MODELS = {
    "deepseek_v3_uniep": "deepseek_v3",
    "qwen3_uniep": "qwen3",
    "llama4_uniep": "llama4",
}


def _register_train_specs() -> None:
    from torchtitan.protocols.train_spec import _extra_train_specs, register_train_spec

    from titan_uniep.parallelize import wrap_parallelize_fn

    for name, base in UNIEP_MODELS.items():
        if name in _extra_train_specs:  # imported twice (custom_import and user code)
            continue
        base_spec = importlib.import_module(f"torchtitan.models.{base}").get_train_spec()
        spec = dataclasses.replace(base_spec, parallelize_fn=wrap_parallelize_fn(base_spec.parallelize_fn))
        register_train_spec(name, spec)


def _register() -> None:
    from titan_uniep.data import register_dataset
    from titan_uniep.flavors import register_flavors

    register_dataset()
    register_flavors()
    _register_train_specs()


def _torchtitan_series() -> str | None:
    """The installed TorchTitan's release series ("0.2", "0.3"), None without it."""
    try:
        return ".".join(importlib.metadata.version("torchtitan").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return None


# The TOML hook is TorchTitan 0.2's; with another release (or none) installed the core
# (layout, kernels, runtime, schedules, op, tuning) still imports.
if _torchtitan_series() == "0.2":
    _register()
