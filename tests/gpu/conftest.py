import fcntl
import os
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    # This hook sees every collected test of the session: only skip ours.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_gpu_test_at_a_time(tmp_path_factory):
    """Under pytest-xdist (the README's ``-n auto``) the GPU tests still run one at a
    time: their persistent kernels spin-wait with bounded waits and need the GPUs to
    themselves (every program of a grid resident)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    # The workers' base temp folders share this parent: one lock for the session.
    with open(tmp_path_factory.getbasetemp().parent / "gpu_tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
