"""scripts/op_host_time.py runs from a clean clone: on CPU it calls the op through
Triton's interpreter (fp32, a tiny layer) and prints its table and profile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_op_host_time_prints_host_and_gpu_times_and_a_profile(tmp_path):
    # TMPDIR: torchrun without --log-dir makes a /tmp/torchelastic_* folder per launch and leaves it;
    # here it (and any other temporary file of the launch) goes into the test's own folder.
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         str(REPO / "scripts" / "op_host_time.py"), "--shape", "24,32,16,4,2", "--calls", "1", "--profile-calls", "1",
         "--top", "5"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "== 24x32x16x4x2 (T=24 D=32 H=16 E=4 K=2, fused, 1 rank(s))" in out.stdout, out.stdout
    assert "| forward |" in out.stdout and "| backward |" in out.stdout, out.stdout
    assert "cProfile of 1 forward + backward calls, by own time:" in out.stdout, out.stdout
