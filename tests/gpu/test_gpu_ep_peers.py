"""The EP-group host / peer-access probe on 2+ real GPUs (``ep_peers_worker.py`` under torchrun)."""

import pytest

from .torchrun_worker import needs_two_gpus, run_worker

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.gpu_exclusive]


@needs_two_gpus
def test_ep_group_probe_sees_one_host_with_peer_access():
    proc = run_worker("ep_peers_worker.py", nproc=2, timeout_s=300)
    assert "EP PEERS OK" in proc.stdout
