"""titan_uniep: UniEP expert parallelism for TorchTitan.

The package is three layers, and importing it imports none of TorchTitan:

- the core, TorchTitan-free: the ``[uniep]`` options (``config``), the
  deterministic layout (``layout``), the schedules and their runtime
  (``schedules``, ``runtime``, ``op``), the kernels (``kernels``), the layer
  parameters and their tuning (``params``, ``tuning``);
- the TorchTitan edges (``titan_uniep.torchtitan``): what every supported
  TorchTitan release shares (the bundled dataset, the start-up checks, the
  launcher, which release is installed), and one package per release
  (``titan_uniep.torchtitan.v0_2`` for TorchTitan 0.2.2);
- the tools (``titan_uniep.tools``): benchmarks, the tuner, loss comparison.

A TorchTitan 0.2.2 train config registers UniEP's train specs with
``[experimental] custom_import = "titan_uniep.torchtitan.v0_2"`` and adds the
``[uniep]`` section with ``[job] custom_config_module = "titan_uniep.config"``.
"""

__version__ = "0.1.0"
