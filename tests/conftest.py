"""Shared by every test module: a GPU test holds a share of the GPU while it
runs (``gpu_share``), so the README's test command passes on one GPU with
however many pytest-xdist workers ``-n auto`` starts."""

import os
from pathlib import Path

# Before CUDA starts in any test process: a hardware work queue per stream of the real-rank
# tests' W ranks (titan_uniep.tools.real_ranks, CONNECTIONS).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import pytest  # noqa: E402
import torch  # noqa: E402

from gpu_share import gpu_slot, slots

_GPU_TESTS = Path(__file__).parent / "gpu"


@pytest.fixture(autouse=True)
def _gpu_share(request, tmp_path_factory):
    """Tests under ``tests/gpu`` or marked ``gpu``, where CUDA is: run while
    holding a GPU slot (every slot: ``gpu_exclusive``), and give the memory
    the caching allocator keeps back before the slot goes to the next test."""
    is_gpu_test = request.node.get_closest_marker("gpu") or _GPU_TESTS in request.node.path.parents
    if not (is_gpu_test and torch.cuda.is_available()):
        yield
        return
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 in a GPU test's process: the processes it starts would run Triton's "
                    "interpreter on the GPU's tensors (tests/interpreter_env.py); unset it")
    # Under xdist every worker's base folder is a child of the run's: the run's slots.
    folder = tmp_path_factory.getbasetemp().parent / "titan_uniep-gpu-slots"
    exclusive = request.node.get_closest_marker("gpu_exclusive") is not None
    with gpu_slot(folder, slots(torch.cuda.get_device_properties(0).total_memory), exclusive=exclusive):
        yield
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
