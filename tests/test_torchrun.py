"""titan_uniep.torchtitan.torchrun: when a worker fails, run_train.sh ends with that worker's own error,
not with torchrun's traceback and table."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
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
    report, status = failure_report(ChildFailedError("titan_uniep.torchtitan.train", failures), "out/x/logs",
                                    stopped_pids={failures[0].pid})
    assert report.splitlines() == [
        "rank 0 was stopped by torchrun (SIGTERM) after rank 1 failed; it had recorded the same error",
        "every rank's output: out/x/logs",
        "rank 1 failed first (exit code 1):",
        *message.splitlines(),
    ]
    assert status == 1


def test_on_a_tie_the_rank_that_ended_by_itself_failed_first_not_the_one_torchrun_stopped(tmp_path):
    # Neither recorded an error, so each failure's time is when torchrun saw the exit, in
    # whole seconds: the rank it stopped a moment later often ties with the one that died.
    failures = {0: _failure(tmp_path, 0, -15, None), 1: _failure(tmp_path, 1, -9, None)}
    failures[0].timestamp = failures[1].timestamp = 100
    report, status = failure_report(ChildFailedError("titan_uniep.torchtitan.train", failures), None,
                                    stopped_pids={failures[0].pid})
    lines = report.splitlines()
    assert lines[0] == "rank 0 was stopped by torchrun (SIGTERM) after rank 1 failed", lines
    assert lines[1].startswith("rank 1 failed first (signal SIGKILL): killed (pid 1001)"), lines
    assert status == 1


def test_a_rank_that_exited_by_itself_before_torchrun_signalled_it_failed_too(tmp_path):
    # torchrun signals every worker it still lists as running; one that was already
    # exiting with its own error ends with its exit code: it failed, it was not stopped.
    message = "RuntimeError: UniEP guard (strict): layer 5 differs"
    failures = {0: _failure(tmp_path, 0, 1, {"message": message, "timestamp": 100}),
                1: _failure(tmp_path, 1, 1, {"message": message, "timestamp": 101})}
    report, _ = failure_report(ChildFailedError("titan_uniep.torchtitan.train", failures), None,
                               stopped_pids={failures[1].pid})
    assert report.splitlines()[0] == "rank 1 failed too (exit code 1): the same error", report


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
    assert report.splitlines()[0] == ("rank 0 failed first (signal SIGKILL): killed (pid 1), so it recorded no error; "
                                      "its output is above."), report


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


# Fake workers for the launcher's own reports: rank 1 fails (or both wait for Ctrl-C), rank 0
# waits to be stopped. Each prints "rank R up" once it runs.
SIGNALLED = """
import os, signal, sys, time
from pathlib import Path
rank = int(os.environ["RANK"])
print(f"rank {rank} up", flush=True)
if sys.argv[1] == "sigint":
    dump = Path(sys.argv[2])  # what a training run keeps in its dump folder
    (dump / "loss.jsonl").write_text('{"step": 1, "loss": 8.0}\\n{"step": 2, "loss": 7.9}\\n{"step": 3, "lo')
    (dump / "checkpoint" / "step-2").mkdir(parents=True, exist_ok=True)
    (dump / "checkpoint" / "step-2" / ".metadata").write_text("")
elif rank == 1:
    time.sleep(0.5)
    if sys.argv[1] == "sigkill":  # as the kernel's out-of-memory killer does
        os.kill(os.getpid(), signal.SIGKILL)
    from titan_uniep.torchtitan.torchrun import exit_with_error
    exit_with_error("[uniep] guard_layer = 9: the model has 5 MoE layers.")
time.sleep(60)
"""


def _launch(tmp_path: Path, mode: str) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(SIGNALLED)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    # Its own session: the test's SIGINT reaches torchrun and its workers, as a terminal's Ctrl-C does.
    return subprocess.Popen([sys.executable, "-m", "titan_uniep.torchtitan.torchrun", "--nproc_per_node=2",
                             "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0", "--role", "rank", "--tee", "3",
                             "--log-dir", str(tmp_path / "logs"), str(script), mode, str(tmp_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the launch ran past 60 s:\n{stderr[-3000:]}")
    return proc.returncode, stderr


def test_a_rank_killed_by_sigkill_is_reported_as_killed_likely_out_of_memory(tmp_path):
    returncode, stderr = _finish(_launch(tmp_path, "sigkill"))
    assert returncode == 1, stderr[-3000:]
    lines = stderr.splitlines()
    # torchrun's own "failed (exitcode: -9) ... of binary: .../python3" line is dropped:
    # the report says it, with the rank's own error.
    assert not any("failed (exitcode" in line for line in lines), stderr
    report = lines[lines.index(f"every rank's output: {tmp_path / 'logs'}") - 1:]
    assert report[0] == "rank 0 was stopped by torchrun (SIGTERM) after rank 1 failed", report
    assert re.fullmatch(r"rank 1 failed first \(signal SIGKILL\): killed \(pid (\d+)\), so it recorded no error; "
                        r"its output is above and in the logs\.", report[2]), report
    pid = re.search(r"pid (\d+)", report[2]).group(1)
    assert report[3:] == [
        "A SIGKILL that torchrun did not send is most likely the kernel's out-of-memory killer; if so, the kernel "
        f"log (dmesg) says \"Killed process {pid}\".",
        "To use less memory: a smaller --training.local_batch_size or --training.seq_len, activation checkpointing, "
        "a smaller model, or a machine with more memory.",
    ], report


def test_a_rank_torchrun_stopped_is_not_said_to_have_failed(tmp_path):
    returncode, stderr = _finish(_launch(tmp_path, "error"))
    assert returncode == 1, stderr[-3000:]
    lines = stderr.splitlines()
    assert not any("failed (exitcode" in line for line in lines), stderr
    assert lines[-4:] == [
        "rank 0 was stopped by torchrun (SIGTERM) after rank 1 failed",
        f"every rank's output: {tmp_path / 'logs'}",
        "rank 1 failed first (exit code 1):",
        "[uniep] guard_layer = 9: the model has 5 MoE layers.",
    ], lines[-6:]


def test_ctrl_c_ends_with_one_line_of_what_was_interrupted_and_kept(tmp_path):
    earlier = tmp_path / "checkpoint" / "step-1"  # an earlier run's, not the last one
    earlier.mkdir(parents=True)
    (earlier / ".metadata").write_text("")
    os.utime(earlier / ".metadata", (0, 0))
    (tmp_path / "checkpoint" / "step-3").mkdir()  # no .metadata: a save cut short, not a checkpoint
    proc = _launch(tmp_path, "sigint")
    up = set()
    while len(up) < 2:  # both ranks running (their output comes through torchrun's stdout)
        line = proc.stdout.readline()
        assert line, "torchrun ended before both ranks started"
        up |= {rank for rank in ("0", "1") if f"rank {rank} up" in line}
    time.sleep(0.5)  # the workers have written their files
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
    returncode, stderr = _finish(proc)
    assert returncode == 128 + signal.SIGINT, stderr[-3000:]
    # The workers' own KeyboardInterrupt tracebacks come through as theirs ([rank<R>]:); torchrun's is gone.
    assert not any(line.startswith("Traceback") for line in stderr.splitlines()), stderr
    assert "SignalException" not in stderr, stderr
    assert stderr.splitlines()[-1] == (
        f"interrupted by SIGINT (Ctrl-C): torchrun stopped every rank; kept: {tmp_path / 'logs'} (every rank's "
        f"output), {tmp_path / 'loss.jsonl'} (steps 1-2), the last checkpoint {tmp_path / 'checkpoint' / 'step-2'}")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process, no group
def test_a_resume_from_a_model_only_checkpoint_says_how_to_resume(tmp_path):
    # TorchTitan saves a run's last step model-only by default; resuming from it fails in
    # torch.distributed.checkpoint with a CheckpointException, a BaseException that neither
    # @record nor TorchTitan's main records: the trainer entry says why and what to do.
    import torch
    import torch.distributed.checkpoint as dcp

    from titan_uniep.torchtitan.train import checkpoint_error

    dcp.save({"tok_embeddings.weight": torch.ones(2)}, checkpoint_id=str(tmp_path))  # the model only
    with pytest.raises(BaseException) as err:
        dcp.load({"tok_embeddings.weight": torch.zeros(2), "dataloader": {"dp_rank_0": torch.zeros(1)}},
                 checkpoint_id=str(tmp_path))
    assert type(err.value).__name__ == "CheckpointException"
    message = checkpoint_error(err.value)
    assert message.startswith("the checkpoint TorchTitan loaded holds the model only (dataloader.dp_rank_0 is not "
                              "in it)"), message
    assert "--checkpoint.load_step N" in message and "checkpoint.last_save_model_only is false" in message
