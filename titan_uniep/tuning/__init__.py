"""Tuning a UniEP layer's ``LayerParams``:

- ``space``: the points (the fields, their choices, which of them keep the
  bits) and the constraint check of a point on a GPU;
- ``hardware`` and ``model``: the GPU's constants and the analytic model of a
  point's time per stage;
- ``calibrate``: the measurement of those constants on a GPU
  (``python -m titan_uniep.tuning.calibrate``);
- ``search``: the measured search of one layer shape, and the bitwise check
  of its pick (``python3 -m titan_uniep.tools.tune`` is its command line);
- ``cache``: the tuning-cache file, its entries and their keys;
- ``selection``: the ``[uniep] tuning`` policy, which point a workspace is
  built with (``"off"``, ``"cached"``, ``"search"`` at start-up).
"""
