"""Real EP on 2 GPUs: runs ``ep_worker.py`` under torchrun (free port via
``--standalone``) and checks that every rank passed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_real_ep_two_gpus():
    worker = Path(__file__).with_name("ep_worker.py")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    print(proc.stdout[-6000:])
    print(proc.stderr[-6000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EP WORKER OK" in proc.stdout
