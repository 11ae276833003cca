"""scripts/gemm_core_probe.py without a GPU: every candidate core computes the
grouped GEMM (skewed routing, an expert with no rows, partial tiles, poisoned
outputs) in Triton's interpreter against float64, and compiles for sm_90 to
wgmma, with tensor copies where it asks for descriptors. Which core is fastest
is the script's GPU run (docs/performance.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gemm_core_probe.py"


def _run(*args: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600)


def test_every_core_matches_float64_in_the_interpreter():
    done = _run("--interpreter-check", interpret=True)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 10 and all(line.endswith(" ok") for line in lines), done.stdout


def test_every_core_compiles_to_wgmma_for_sm90():
    done = _run("--compile-only", interpret=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 10 and all("wgmma yes" in line and "spill stores 0 B" in line for line in lines), done.stdout
    for line in lines:
        uses_descriptors = "tma=True" in line
        assert ("tensor copies 0," not in line) == uses_descriptors, line
