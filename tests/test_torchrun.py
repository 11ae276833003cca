"""titan_uniep.torchtitan.torchrun: when a worker fails, run_train.sh ends with that worker's own error,
not with torchrun's traceback and table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


KILLED_WHILE_RECORDING = """
import builtins, os, signal, sys
from torch.distributed.elastic.multiprocessing.errors import record
from titan_uniep.torchtitan.torchrun import exit_with_error, record_errors_whole

real_open = builtins.open

class KilledOnWrite:  # the process dies (as under torchrun's SIGTERM) the moment it writes to a file
    def __init__(self, f):
        self.f = f
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
    def write(self, text):
        os.kill(os.getpid(), signal.SIGKILL)

def open_killed_on_write(path, mode="r", *args, **kwargs):
    f = real_open(path, mode, *args, **kwargs)
    return KilledOnWrite(f) if "w" in mode else f

@record  # as TorchTitan's main
def fail():
    raise RuntimeError("UniEP guard: layer 3 differs")

builtins.open = open_killed_on_write
if sys.argv[1] == "exit_with_error":
    exit_with_error("[uniep] guard_layer = 9: the model has 5 MoE layers.")
record_errors_whole()  # titan_uniep.torchtitan.train installs it
fail()
"""


@pytest.mark.parametrize("recorder", ["exit_with_error", "record"])
def test_a_worker_stopped_while_recording_its_error_leaves_no_file_torchrun_cannot_read(tmp_path, recorder):
    # torchrun stops the other ranks once one has failed; a rank stopped half way through
    # recording the same error must not leave a file torchrun's agent fails to parse.
    script = tmp_path / "worker.py"
    script.write_text(KILLED_WHILE_RECORDING)
    error_file = tmp_path / "error.json"
    env = dict(os.environ, TORCHELASTIC_ERROR_FILE=str(error_file),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), recorder], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -9, (proc.returncode, proc.stderr)  # it did die while writing
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-9,
                             error_file=str(error_file))  # parses the file: raises on a partial one
    report, _ = failure_report(ChildFailedError("worker", {0: failure}), None)
    assert report.splitlines()[-1] == "rank 0 failed first (signal SIGKILL); it recorded no error: its output is above"


def test_record_errors_whole_records_what_torchelastic_records(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    from titan_uniep.torchtitan.torchrun import record_errors_whole

    monkeypatch.setattr(ErrorHandler, "record_exception", ErrorHandler.record_exception)  # restored after
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    record_errors_whole()
    record_errors_whole()  # installing it twice is harmless
    try:
        raise RuntimeError("UniEP guard: layer 3 differs")
    except RuntimeError as err:
        ErrorHandler().record_exception(err)
    assert os.environ["TORCHELASTIC_ERROR_FILE"] == str(error_file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.json"]  # no partial file left
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"] == "RuntimeError: UniEP guard: layer 3 differs"
    assert "raise RuntimeError" in recorded["extraInfo"]["py_callstack"]
