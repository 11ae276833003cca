"""scripts/profile_summary.py on a small synthetic trace: busy time, kinds, and where the GPU waits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_summary.py"


def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_idle_gaps_name_the_kernels_around_them_and_the_cpu_op_meanwhile(tmp_path):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#10", "ts": 0, "dur": 2000},
        kernel("dispatch_fc1_kernel", 100, 300),
        kernel("elementwise_kernel_copy", 350, 100),  # overlaps the first: no gap
        kernel("multi_tensor_apply_kernel_adam", 950, 400),  # 500 us after the copy ends
        kernel("fc2_combine_kernel", 1370, 30),  # a 20 us gap
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 600, "dur": 200},
        {"ph": "X", "cat": "cpu_op", "name": "aten::to", "ts": 500, "dur": 400},
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(trace), "--gap-us", "100"], capture_output=True,
                         text=True, check=True).stdout
    assert "busy 0.78 ms" in out, out  # 100-450, 950-1350, 1370-1400
    assert "ProfilerStep#10: 2.00 ms on the host" in out, out
    assert "GPU idle between its first and last event: 0.52 ms in 2 gaps, 0.50 ms of it in 1 gaps of 100 us" in out, out
    assert "| 500 | elementwise_kernel_copy | multi_tensor_apply_kernel_adam | aten::copy_ |" in out, out
    assert "| optimizer | 0.40 |" in out and "| uniep megakernels | 0.33 |" in out, out
