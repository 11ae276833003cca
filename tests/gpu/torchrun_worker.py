"""Run a worker script of this folder under torchrun, as the real-EP tests do.

``--standalone`` lets torchrun's rendezvous pick a free port, so tests never
collide on one; the checkout goes first on ``PYTHONPATH`` so the workers import
this ``titan_uniep``, installed or not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 GPUs")


def run_worker(script: str, *, nproc: int, timeout_s: int) -> subprocess.CompletedProcess:
    """Run ``tests/gpu/<script>`` on ``nproc`` processes (one per GPU) and return once it exits.

    The worker's output is printed (its last 6000 characters per stream): pytest shows it
    for a failed test, and with ``-s`` for every test. Raises AssertionError, with the
    tails of its output, if the worker exits nonzero.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         str(Path(__file__).with_name(script))],
        env=env, capture_output=True, text=True, timeout=timeout_s,
    )
    print(proc.stdout[-6000:])
    print(proc.stderr[-6000:])
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc
