"""GPU tests: skipped without CUDA.

They may run in parallel (pytest-xdist, several processes on one GPU): each
persistent grid is one launch of one process, and the driver time-slices
whole contexts, so a grid's programs stay resident together while it runs.
A few GPU tests at once (``tests/gpu_share.py``); the real-rank tests, which
time how fast every rank stops, hold the card alone (``gpu_exclusive``).
The sampled-point test compiles a kernel set per test, which is what the
workers share out (``docs/design.md``, "Schedule and numerics fields").
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    # This hook sees every collected test of the session: only skip ours.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A one-rank NCCL group in this process (each xdist worker its own)."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "file"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
    yield dist.group.WORLD
    dist.destroy_process_group()
