"""titan_uniep.torchtitan.torchrun: when a worker fails, run_train.sh ends with that worker's own error,
not with torchrun's traceback and table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from titan_uniep.torchtitan.torchrun import failure_report

REPO = Path(__file__).resolve().parents[1]


def _failure(tmp_path: Path, rank: int, exitcode: int, record: dict | None) -> ProcessFailure:
    error_file = tmp_path / f"error{rank}.json"
    if record is not None:
        error_file.write_text(json.dumps(record))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def test_report_ends_with_the_recorded_error_of_the_rank_that_failed_first(tmp_path):
    message = "[uniep] schedule = 'fused' needs CUDA GPUs ...\nUse schedule = \"reference\" on CPU."
    failures = {
        0: _failure(tmp_path, 0, -15, {"message": message, "timestamp": 200}),  # stopped by torchrun
        1: _failure(tmp_path, 1, 1, {"message": message, "timestamp": 100}),
    }
    report, status = failure_report(ChildFailedError("titan_uniep.torchtitan.train", failures), "out/x/logs")
    assert report.splitlines() == [
        "rank 0 failed too (signal SIGTERM): the same error",
        "every rank's output: out/x/logs",
        "rank 1 failed first (exit code 1):",
        *message.splitlines(),
    ]
    assert status == 1


def test_report_points_to_the_traceback_torchtitan_recorded(tmp_path):
    # TorchTitan's @record writes the exception and its traceback.
    record = {"message": {"message": "RuntimeError: UniEP guard: layer 3 differs",
                          "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "100"}}}
    failures = {0: _failure(tmp_path, 0, 1, record), 1: _failure(tmp_path, 1, 1, None)}
    report, status = failure_report(ChildFailedError("titan_uniep.torchtitan.train", failures), None)
    lines = report.splitlines()
    assert lines[0] == "rank 1 failed too (exit code 1)", lines
    assert lines[-2:] == [f"rank 0 failed first (exit code 1); traceback in {tmp_path / 'error0.json'}:",
                          "RuntimeError: UniEP guard: layer 3 differs"], lines


def test_report_of_a_worker_that_recorded_nothing_says_where_its_output_is(tmp_path):
    failures = {0: _failure(tmp_path, 0, 2, None)}  # e.g. tyro's usage error, exit 2
    report, status = failure_report(ChildFailedError("titan_uniep.torchtitan.train", failures), "out/x/logs")
    assert report.splitlines()[-1] == ("rank 0 failed first (exit code 2); it recorded no error: its output is above "
                                       "and in the logs")
    assert status == 2


WORKER = """
from titan_uniep.torchtitan.torchrun import exit_with_error
exit_with_error("[uniep] guard_layer = 9: the model has 5 MoE layers. Set guard_layer to -5 .. 4.")
"""


def test_a_failed_launch_ends_with_the_workers_message_and_no_torchrun_traceback(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "titan_uniep.torchtitan.torchrun", "--nproc_per_node=2",
                           "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0", "--log-dir", str(tmp_path / "logs"),
                           str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == ("[uniep] guard_layer = 9: the model has 5 MoE layers. Set guard_layer to "
                                           "-5 .. 4."), proc.stderr
