"""Real EP on 2 GPUs: runs ``ep_worker.py`` under torchrun (free port via
``--standalone``) and checks that every rank passed."""

import pytest

from .torchrun_worker import needs_two_gpus, run_worker

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.gpu_exclusive]


@needs_two_gpus
def test_real_ep_two_gpus():
    proc = run_worker("ep_worker.py", nproc=2, timeout_s=600)
    assert "EP WORKER OK" in proc.stdout
