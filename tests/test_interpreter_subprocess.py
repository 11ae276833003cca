"""Runs the interpreter tests (test_kernels.py, test_backward.py, test_scoreboard.py, test_op.py,
test_tuning_space.py, test_ordered_sums.py) in a fresh process when this one cannot.

The Triton interpreter needs TRITON_INTERPRET=1 before ``import triton``
(Triton's own jit helpers such as ``tl.cdiv`` are defined at import). When an
earlier test module already imported triton (torchtitan does), the in-process
tests skip themselves and this test runs them in a subprocess instead.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch


def _triton_is_interpreted() -> bool:
    if "triton" not in sys.modules:
        return True  # the test modules set the variable before importing it
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.cdiv, InterpretedFunction)


#: How the skip of a test of one TorchTitan edge on another stack starts: the only skip
#: these modules may report (a test module's mark for one release's edge).
OTHER_STACK_SKIP = "needs TorchTitan "
MODULES = ("test_kernels.py", "test_backward.py", "test_scoreboard.py", "test_op.py", "test_tuning_space.py",
           "test_ordered_sums.py")
_run: dict = {}


def _workers() -> list[str]:
    """pytest-xdist spreads the modules' tests over the cores (one
    single-threaded interpreter process per core; a whole module per process
    would leave a core idle while the longest module runs on)."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        return []
    return ["-n", str(max(1, min(os.cpu_count() or 1, 4))), "--dist", "load"]


def _results() -> tuple[subprocess.CompletedProcess, dict[str, dict[str, int]]]:
    """Run every module once, in one fresh pytest process with TRITON_INTERPRET=1
    (shared by the parametrized tests below), and count each module's
    outcomes from its JUnit report."""
    if not _run:
        tests_dir = Path(__file__).parent
        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join([str(tests_dir.parent), env.get("PYTHONPATH", "")])
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.xml"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_workers(),
                   f"--junitxml={report}", *(str(tests_dir / m) for m in MODULES)]
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
            except subprocess.TimeoutExpired as e:
                pytest.fail(f"the interpreter tests ran past 1500 s:\n{(e.stdout or '')[-3000:]}")
            counts = {m: {"passed": 0, "failed": 0, "skipped": 0, "other stack": 0} for m in MODULES}
            if report.exists():
                for case in ElementTree.parse(report).iter("testcase"):
                    module = case.get("classname", "").split(".")[-1] + ".py"
                    if module not in counts:
                        continue
                    skipped = case.find("skipped")
                    outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                               else "passed" if skipped is None
                               # the only skip allowed: a test of another stack's TorchTitan edge
                               else "other stack" if skipped.get("message", "").startswith(OTHER_STACK_SKIP)
                               else "skipped")
                    counts[module][outcome] += 1
        _run["proc"], _run["counts"] = proc, counts
    return _run["proc"], _run["counts"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tests")
@pytest.mark.timeout(1600)
@pytest.mark.parametrize("module", MODULES)
def test_kernel_tests_in_a_fresh_interpreter_process(module):
    if _triton_is_interpreted():
        pytest.skip(f"{module} runs in this process")
    proc, counts = _results()
    mine = counts[module]
    assert mine["failed"] == 0 and mine["passed"] > 0 and mine["skipped"] == 0, (
        f"{module}: {mine}\n{proc.stdout[-6000:]}{proc.stderr[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
