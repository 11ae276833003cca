"""GPU tests: skipped without CUDA.

They may run in parallel (pytest-xdist, several processes on one GPU): each
persistent grid is one launch of one process, and the driver time-slices
whole contexts, so a grid's programs stay resident together while it runs.
The sampled-point test compiles a kernel set per test, which is what the
workers share out (``docs/design.md``, "Schedule and numerics fields").
"""

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
