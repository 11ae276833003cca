"""The custom op on one GPU at EP = 1, eager and compiled: runs ``op_worker.py``
under torchrun (one process, free port via ``--standalone``) and checks that
every part passed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_op_eager_and_compiled_on_one_gpu():
    worker = Path(__file__).with_name("op_worker.py")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(worker)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    print(proc.stdout[-6000:])
    print(proc.stderr[-6000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OP WORKER OK" in proc.stdout
