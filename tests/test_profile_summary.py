"""scripts/profile_summary.py on a small synthetic trace: busy time, kinds, and where the GPU waits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_summary.py"


def kernel(name, ts, dur, correlation=None):
    event = {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def launch(ts, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5, "tid": 9,
            "args": {"correlation": correlation}}


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


def test_host_time_by_op_counts_own_time_without_callees(tmp_path):
    step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#10", "ts": 0, "dur": 1000, "tid": 1}
    events = [
        step,
        kernel("dispatch_fc1_kernel", 100, 300),
        {"ph": "X", "cat": "cpu_op", "name": "uniep::moe_experts", "ts": 100, "dur": 400, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 150, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 300, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 400, "dur": 20, "tid": 1},
        # the autograd thread, meanwhile
        {"ph": "X", "cat": "cpu_op", "name": "uniep::moe_experts_backward", "ts": 200, "dur": 300, "tid": 2},
        # after the profiled step: not counted
        {"ph": "X", "cat": "cpu_op", "name": "uniep::moe_experts", "ts": 1200, "dur": 400, "tid": 1},
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(trace)], capture_output=True, text=True, check=True).stdout
    assert "(1.00 ms, 0.60 ms of it in no op): tid 1 1.00 ms, tid 2 0.30 ms" in out, out
    assert "| uniep::moe_experts | 1 | 280 | 400 |" in out, out  # 400 - 2 x 50 - 20 of its own
    assert "| cudaLaunchKernel | 2 | 100 | 100 |" in out, out
    assert "| uniep::moe_experts_backward | 1 | 300 | 300.0 |" in out, out  # framework table: with callees
    assert "| cudaLaunchKernel | 2 | 100 | 50.0 |" not in out, out  # CUDA API calls are not framework ops


def test_only_the_work_the_profiled_step_launched_counts(tmp_path):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#13", "ts": 1000, "dur": 2000},
        launch(500, 1), kernel("multi_tensor_apply_kernel_adam", 1000, 600, 1),  # the step before's optimizer
        launch(1100, 2), kernel("dispatch_fc1_kernel", 1700, 300, 2),
        launch(1200, 3), kernel("fc2_combine_kernel", 2100, 100, 3),
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(trace), "--gap-us", "50"], capture_output=True, text=True,
                         check=True).stdout
    assert "2 GPU events launched in ProfilerStep#13 (1 others left out) over 0.50 ms, busy 0.40 ms" in out, out
    assert "| optimizer |" not in out, out
    assert "GPU idle between its first and last event: 0.10 ms in 1 gaps" in out, out
