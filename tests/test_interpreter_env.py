"""``interpreter_env.request_interpreter``: Triton's interpreter is turned on
only in a process whose interpreter tests can run (no CUDA, Triton not
imported yet), never left on for a GPU test of the same pytest worker."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

PROBE = """
import os, sys
sys.path.insert(0, {tests!r})
{setup}
from interpreter_env import request_interpreter
print(request_interpreter(), os.environ.get("TRITON_INTERPRET"))
"""


def _probe(setup: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PROBE.format(tests=str(TESTS), setup=setup)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.mark.parametrize("setup, expected", [
    ("import torch; torch.cuda.is_available = lambda: False", "True 1"),
    ("import triton", "False None"),  # Triton imported first (a GPU test module was collected before)
    ("import torch; torch.cuda.is_available = lambda: True", "False None"),  # a GPU machine
], ids=["cpu_fresh", "triton_imported", "cuda"])
def test_the_interpreter_is_requested_only_where_its_tests_run(setup, expected):
    assert _probe(setup) == expected


LAUNCH_PROBE = """
import os, sys
{before}
from titan_uniep.runtime import launch
os.environ["TRITON_INTERPRET"] = {later!r}
print(launch.interpreting())
"""


@pytest.mark.parametrize("before, later, expected", [
    ("os.environ['TRITON_INTERPRET'] = '1'", "0", "True"),  # interpreted kernels; the variable unset later
    ("os.environ['TRITON_INTERPRET'] = '0'", "1", "False"),  # compiled kernels; the variable set later
], ids=["interpreted", "compiled"])
def test_the_runtime_follows_how_the_kernels_were_defined_not_the_variable_now(before, later, expected):
    """A GPU test's waits are bounded in microseconds and its kernels take the
    compiled branches even where a test module set ``TRITON_INTERPRET`` after
    the kernels were defined (``runtime.launch.interpreting``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", LAUNCH_PROBE.format(before=before, later=later)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == expected


MODE_PROBE = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from titan_uniep.runtime import launch
launch.check_kernel_mode(torch.device("cpu"))
try:
    launch.check_kernel_mode(torch.device("cuda"))
except RuntimeError as e:
    print("refused:", e)
"""


def test_interpreted_kernels_refuse_gpu_tensors():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", MODE_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused:" in proc.stdout and "unset TRITON_INTERPRET" in proc.stdout, proc.stdout
