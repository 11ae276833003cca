"""Runs the interpreter kernel tests (test_kernels.py, test_backward.py, test_scoreboard.py) in a fresh process when
this one cannot.

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


MODULES = ("test_kernels.py", "test_backward.py", "test_scoreboard.py")
_runs: dict[str, subprocess.Popen] = {}


def _start_all() -> None:
    """Start every module's subprocess at once (one interpreter process per
    core: they are single-threaded and take minutes each)."""
    for module in MODULES:
        if module in _runs:
            continue
        tests = Path(__file__).with_name(module)
        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join([str(tests.parents[1]), env.get("PYTHONPATH", "")])
        _runs[module] = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
                                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tests")
@pytest.mark.parametrize("module", MODULES)
def test_kernel_tests_in_a_fresh_interpreter_process(module):
    if _triton_is_interpreted():
        pytest.skip(f"{module} runs in this process")
    _start_all()
    proc = _runs[module]
    try:
        stdout, stderr = proc.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"{module} ran past 1200 s:\n{stdout[-3000:]}")
    assert proc.returncode == 0, stdout[-6000:] + stderr[-3000:]
    assert re.search(r"\b[1-9]\d* passed", stdout) and " skipped" not in stdout, stdout[-3000:]
