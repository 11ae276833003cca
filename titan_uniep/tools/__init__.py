"""Tools run from the command line (``python3 -m titan_uniep.tools.NAME``): the layer
benchmarks (``bench``, ``bench_backward``, their ``report``), the training benchmark
(``bench_train``), the tuner (``tune``), the loss comparison (``compare_loss``) and the
memory check of a training run (``memory_flat``) and real-rank mode on one GPU
(``real_ranks``)."""

from __future__ import annotations

import argparse
import os


def require_gpu_under_torchrun(parser: argparse.ArgumentParser, prog: str, module: str) -> None:
    """Stop a layer bench in one line where it cannot run: without a CUDA GPU, or
    not started by torchrun (before any CUDA or NCCL call fails deep in torch)."""
    import torch

    if not torch.cuda.is_available():
        parser.exit(2, f"{prog}: error: it times CUDA kernels: it needs a CUDA GPU (on a CPU, "
                       "python3 -m pytest tests/test_op.py checks the same op in Triton's interpreter)\n")
    if "RANK" not in os.environ:
        parser.exit(2, f"{prog}: error: launch it with torchrun, one process per GPU of the EP group: "
                       f"torchrun --nproc_per_node 1 -m {module} --shape ...\n")

