"""titan_uniep: UniEP expert parallelism for TorchTitan.

The package is three layers, and importing it imports none of TorchTitan:

- the core, TorchTitan-free: the ``[uniep]`` options (``config``), the
  deterministic layout (``layout``), the schedules and their runtime
  (``schedules``, ``runtime``, ``op``), the kernels (``kernels``), the layer
  parameters and their tuning (``params``, ``tuning``);
- the TorchTitan edges (``titan_uniep.torchtitan``): what every supported
  TorchTitan release shares (the bundled dataset, the start-up checks, the
  launcher, which release is installed), and one package per release
  (``titan_uniep.torchtitan.v0_2`` for TorchTitan 0.2.2,
  ``titan_uniep.torchtitan.v0_3`` for 0.3.0; ``torchtitan.edge_module()``
  names the installed one's);
- the tools (``titan_uniep.tools``), on top of both: the command lines of the
  benchmarks, the tuner, the loss comparison and the memory check.

A TorchTitan 0.2.2 train config registers UniEP's train specs with
``[experimental] custom_import = "titan_uniep.torchtitan.v0_2"`` and adds the
``[uniep]`` section with ``[job] custom_config_module = "titan_uniep.config"``.
On 0.3.0 a train config names UniEP's config registry
(``--module titan_uniep.torchtitan.v0_3 --config NAME``, or ``module`` and
``config`` in a TOML), whose trainer's config has the ``uniep`` section.
"""

__version__ = "0.1.0"
