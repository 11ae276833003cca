"""The UniEP backward on 2 real GPUs (``ep_backward_worker.py`` under torchrun): fused ==
sequential bitwise for every gradient, close to float64, and no host sync in the fused backward."""

import pytest

from .torchrun_worker import needs_two_gpus, run_worker

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.gpu_exclusive]


@needs_two_gpus
def test_real_ep_backward_fused_equals_sequential_bitwise_on_two_gpus():
    proc = run_worker("ep_backward_worker.py", nproc=2, timeout_s=600)
    # Each rank prints its own verdict (and the worker exits 1 on any FAIL line).
    for rank in range(2):
        assert f"rank {rank}: ALL PASS" in proc.stdout, f"rank {rank} printed no ALL PASS"
