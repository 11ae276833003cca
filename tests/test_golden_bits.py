"""The kernels' output bits are those frozen in tests/golden/ (before the
LayerParams / runtime restructure): forward output, h1 | h3 and every gradient
of the backward (on the saved h1 | h3), both schedules, simulated worlds
W = 1, 2, 4, both score modes, every case of ``make_golden.py``.

CI runs the interpreter cases that cover each feature once (the whole set
takes about 2 CPU-minutes: ``python tests/golden/make_golden.py --check
tests/golden/interpreter.json``); the GPU test checks every bf16 case."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).parent / "golden"

# One case per feature: W = 4 skewed with an empty rank, W = 2 with K = 3 and a
# rank without tokens, local_first, fp16, W = 1; both score modes appear.
CI_CASES = ("cpu_w4_e8_k2_skewed_after|cpu_w2_e4_k3_random_before|cpu_w2_e6_k2_localfirst_after|"
            "cpu_w2_e4_k2_fp16_before|cpu_w1_e4_k2_random_after")


def _check(golden: Path, device: str, only: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(GOLDEN / "make_golden.py"), "--device", device, "--check", str(golden)]
    if only:
        cmd += ["--only", only]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter digests (the GPU test checks the bf16 ones)")
def test_interpreter_outputs_and_gradients_equal_the_golden_digests():
    proc = _check(GOLDEN / "interpreter.json", "cpu", CI_CASES)
    assert proc.returncode == 0 and "0 mismatched of 5" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or "H200" not in torch.cuda.get_device_name(),
                    reason="the bf16 digests were taken on an H200")
def test_gpu_outputs_and_gradients_equal_the_golden_digests():
    proc = _check(GOLDEN / "h200_bf16.json", "cuda")
    assert proc.returncode == 0 and "0 mismatched" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
