"""Runs the interpreter kernel tests (test_kernels.py, test_backward.py) in a fresh process when this one cannot.

The Triton interpreter needs TRITON_INTERPRET=1 before ``import triton``
(Triton's own jit helpers such as ``tl.cdiv`` are defined at import). When an
earlier test module already imported triton (torchtitan does), the in-process
tests skip themselves and this test runs them in a subprocess instead.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _triton_is_interpreted() -> bool:
    if "triton" not in sys.modules:
        return True  # the test modules set the variable before importing it
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.cdiv, InterpretedFunction)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tests")
@pytest.mark.parametrize("module", ["test_kernels.py", "test_backward.py"])
def test_kernel_tests_in_a_fresh_interpreter_process(module):
    if _triton_is_interpreted():
        pytest.skip(f"{module} runs in this process")
    tests = Path(__file__).with_name(module)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tests.parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(r"\b[1-9]\d* passed", proc.stdout) and " skipped" not in proc.stdout, proc.stdout[-3000:]
