"""Tools run from the command line (``python3 -m titan_uniep.tools.NAME``): the layer
benchmarks (``bench``, ``bench_backward``, their ``report``), the training benchmark
(``bench_train``), the tuner (``tune``), the loss comparison (``compare_loss``) and the
memory check of a training run (``memory_flat``)."""
