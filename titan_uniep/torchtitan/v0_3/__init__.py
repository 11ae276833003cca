"""UniEP's edge for TorchTitan 0.3.0 (Python config registries, ``RoutedExperts`` overrides).

- ``experts``: ``UniEPRoutedExperts``, the ``@override(target=RoutedExperts.Config)``
  that runs ``torch.ops.uniep.moe_experts`` (or the reference schedule) in place
  of TorchTitan's token dispatcher and grouped GEMMs;
- ``trainer``: ``UniEPTrainer``, TorchTitan's trainer whose config has a
  ``uniep`` section (``--uniep.schedule fused``), with UniEP's checks;
- ``config_registry``: the baseline / UniEP pairs (``--module
  titan_uniep.torchtitan.v0_3 --config qwen3_debug_moe_uniep``);
- ``flavors``: the realistic-shape and tiny models;
- ``toml``: a TOML train config naming the module and config, applied through
  TorchTitan's own config manager;
- ``preflight``: the worker's start-up checks (``parse_job``), this edge's side
  of ``titan_uniep.torchtitan.preflight``;
- ``train``: ``run_train.sh``'s trainer on 0.3.0; ``cpu``: its CPU shims.
"""
