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
