"""torchrun with a short failure report; run_train.sh launches training through it.

    python3 -m titan_uniep.torchtitan.torchrun [torchrun arguments] -m titan_uniep.torchtitan.train [training arguments]

The arguments are torchrun's (``torch.distributed.run``), unchanged, and so is
everything until a worker fails. Then torchrun logs its own ``failed
(exitcode: ...) ... of binary: .../python3`` line and raises
``ChildFailedError``, whose report is a traceback of the launcher itself and a
table (about 40 lines) after the worker's own message. This drops that line
(the report below says the same, with the rank's own error) and prints instead
one line per other rank (failed too, or stopped by torchrun once the first had
failed), where their logs are, and last the error of the rank that failed
first, as the worker recorded it in its torchelastic error file: TorchTitan's
``@record`` writes the exception there; the trainer writes its start-up errors
there with ``exit_with_error``. A rank killed by SIGKILL records nothing; the
report then names the likely cause (the kernel's out-of-memory killer) and what
to try. It exits with that rank's exit code (1 for a signal).

When torchrun itself gets a signal (Ctrl-C: SIGINT; a scheduler's SIGTERM), it
stops every rank and raises ``SignalException``; this ends instead with one
line saying so and what the run leaves (``run_train.sh`` puts the logs in
``<dump_folder>/logs``: every rank's output, ``loss.jsonl`` and the last
checkpoint, each said to be an earlier run's where this run did not write it),
exit status 128 + the signal's number.

It needs torch only: importing ``titan_uniep`` and ``titan_uniep.torchtitan``
imports no TorchTitan.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Collection
from typing import NoReturn

__all__ = ["AgentLog", "exit_with_error", "failure_report", "main", "record_errors_whole"]


def exit_with_error(message: str) -> NoReturn:
    """End a worker with ``message``: recorded for the launcher's report (when torchrun
    gave the worker an error file that nothing has written yet: TorchTitan's ``@record``
    keeps the traceback there), printed as ``error: ...``, exit status 1."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and not os.path.exists(error_file):
        # The plain-string form of torchelastic's error file: the report prints the message
        # as it is, with no traceback (a configuration error has nothing to trace).
        _write_whole(error_file, json.dumps({"message": message, "timestamp": int(time.time())}))
    sys.exit(f"error: {message}")


def _partial_path(path: str) -> str:
    return f"{path}.{os.getpid()}.partial"


def _write_whole(path: str, text: str) -> None:
    """Write ``path`` so that it exists only with all of ``text``.

    Every rank meets a configuration error at once, and torchrun sends SIGTERM to
    the others as soon as the first exits: a rank stopped between creating its
    error file and writing it would leave an empty file, which torchrun's agent
    fails to parse (a JSONDecodeError out of the launcher, no report). A file
    renamed into place is either absent or complete."""
    partial = _partial_path(path)
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(partial, path)


def record_errors_whole() -> None:
    """Make torchelastic's ``@record`` (TorchTitan's ``main``) write a worker's error file whole.

    Its ``ErrorHandler.record_exception`` opens the file, then writes the JSON:
    when a fault stops every rank at once, the rank torchrun stops with SIGTERM in
    between leaves an empty file, and torchrun's agent fails to parse it (a
    JSONDecodeError out of the launcher instead of the report). This has it write
    a partial file beside the error file and rename it into place: the same
    content, and the error file is absent or complete. Installed once per process."""
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    original = ErrorHandler.record_exception
    if getattr(original, "_uniep_whole", False):
        return

    def record_exception(self, e: BaseException) -> None:
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if not path:
            return original(self, e)
        partial = _partial_path(path)
        os.environ["TORCHELASTIC_ERROR_FILE"] = partial
        try:
            original(self, e)
        finally:
            os.environ["TORCHELASTIC_ERROR_FILE"] = path
        if os.path.exists(partial):
            os.replace(partial, path)

    record_exception._uniep_whole = True
    ErrorHandler.record_exception = record_exception


AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
"""The logger of the torchrun module that starts and stops the workers: it logs each
worker it stops and its ``failed (exitcode ...)`` line."""


class AgentLog(logging.Filter):
    """A filter on torchrun's ``AGENT_LOGGER``: notes the pids of the workers torchrun
    stops itself, and drops its ``failed (exitcode: ...)`` line.

    Once a worker has failed, torchrun sends the others SIGTERM (``Sending process
    <pid> closing signal SIGTERM``; SIGKILL after 30 s: ``Unable to shutdown process
    <pid> ...``), so their exit status is a signal too: these pids tell a rank torchrun
    stopped from one that failed by itself. Its ``failed (exitcode: 1) local_rank: 0
    (pid: ...) of binary: .../python3`` line would come before the report, which
    says the same with the rank's own error. (With ``LOGLEVEL=ERROR`` torchrun logs
    no warnings, and the stopped ranks read as failed.)"""

    def __init__(self):
        super().__init__()
        self.stopped_pids: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith(("Sending process", "Unable to shutdown process")) and record.args:
            self.stopped_pids.add(int(record.args[0]))
        return not message.startswith("failed (exitcode")


def _exit_status(failure) -> str:
    if failure.exitcode < 0:
        return f"signal {failure.signal_name()}"
    return f"exit code {failure.exitcode}"


def _recorded(failure) -> tuple[str | None, bool]:
    """``(message, has_traceback)`` of the worker's error file (None: it wrote none)."""
    if not os.path.isfile(failure.error_file):
        return None, False
    message = failure.message
    if isinstance(message, dict):  # TorchTitan's @record: the exception, its traceback in extraInfo
        return str(message.get("message", "")), bool(message.get("extraInfo", {}).get("py_callstack"))
    return str(message), False


def _out_of_memory_hint(failure) -> list[str]:
    """What to say of a rank that something other than torchrun killed with SIGKILL."""
    return [
        f"A SIGKILL that torchrun did not send is most likely the kernel's out-of-memory killer; if so, "
        f"the kernel log (dmesg) says \"Killed process {failure.pid}\".",
        "To use less memory: a smaller --training.local_batch_size or --training.seq_len, activation "
        "checkpointing, a smaller model, or a machine with more memory.",
    ]


def failure_report(err, log_dir: str | None, stopped_pids: Collection[int] = frozenset()) -> tuple[str, int]:
    """The report of a ``ChildFailedError`` and the exit status to end with.

    ``stopped_pids``: the workers torchrun stopped itself once one had failed
    (``AgentLog``). One line per other rank (failed too, or stopped by
    torchrun), where the logs are, and last the rank that failed first with
    its recorded message (or, where it recorded none, why and where its output is)."""
    failures = err.failures
    # (torchrun signals every worker still listed as running: one that exited by itself meanwhile failed)
    stopped = {rank for rank, failure in failures.items() if failure.pid in stopped_pids and failure.exitcode < 0}
    # torchrun's own order (the error file's time, else when torchrun saw the exit; whole
    # seconds), except that on a tie a rank torchrun stopped comes after one that ended by itself.
    first_rank = min(failures, key=lambda rank: (failures[rank].timestamp, rank in stopped, rank))
    first = failures[first_rank]
    # The rank whose exit made torchrun stop the others.
    trigger = min(failures, key=lambda rank: (rank in stopped, failures[rank].timestamp, rank))
    message, traced = _recorded(first)
    lines = []
    for rank, failure in sorted(failures.items()):
        if rank == first_rank:
            continue
        other, _ = _recorded(failure)
        said = None if not other else "the same error" if other == message else other.splitlines()[0]
        if rank in stopped:
            line = f"rank {rank} was stopped by torchrun ({failure.signal_name()}) after rank {trigger} failed"
            lines.append(line + (f"; it had recorded {said}" if said else ""))
        elif failure.exitcode == -signal.SIGKILL and said is None:
            lines.append(f"rank {rank} failed too (signal SIGKILL): killed, likely out of memory")
        else:
            lines.append(f"rank {rank} failed too ({_exit_status(failure)})" + (f": {said}" if said else ""))
    if log_dir:
        lines.append(f"every rank's output: {log_dir}")
    if first_rank in stopped:  # it recorded its error before the rank that exited first did
        head = f"rank {first_rank} failed first (then torchrun stopped it with {first.signal_name()})"
    else:
        head = f"rank {first_rank} failed first ({_exit_status(first)})"
    where = "its output is above" + (" and in the logs" if log_dir else "")
    if message is not None:
        if traced:
            head += f"; traceback in {first.error_file}"
        lines += [f"{head}:", message]
    elif first.exitcode == -signal.SIGKILL and first_rank not in stopped:
        lines += [f"{head}: killed (pid {first.pid}), so it recorded no error; {where}.",
                  *_out_of_memory_hint(first)]
    else:
        lines.append(f"{head}; it recorded no error: {where}")
    return "\n".join(lines), first.exitcode if first.exitcode > 0 else 1


def _kept(log_dir: str | None, since: float) -> str:
    """What an interrupted run leaves: the logs, and in the dump folder that ``run_train.sh``
    puts them in (``<dump_folder>/logs``), ``loss.jsonl`` and the checkpoint a rerun would
    resume from (TorchTitan's latest complete ``step-N``), each said to be an earlier run's
    where this run did not write it (modified before ``since``)."""
    if not log_dir:
        return "every rank's output went to this terminal only (no --log-dir)"

    def before_this_run(path: str) -> bool:
        return os.path.getmtime(path) < since

    kept = [f"{log_dir} (every rank's output)"]
    dump_folder = os.path.dirname(os.path.abspath(log_dir))
    loss_file = os.path.join(dump_folder, "loss.jsonl")
    if os.path.isfile(loss_file):
        steps = []
        with open(loss_file, encoding="utf-8") as f:
            for line in f:
                try:
                    steps.append(int(json.loads(line)["step"]))
                except (ValueError, KeyError, TypeError):  # a line cut short by the interruption
                    pass
        span = "no steps" if not steps else f"step {steps[0]}" if len(set(steps)) == 1 else \
            f"steps {min(steps)}-{max(steps)}"
        kept.append(f"{loss_file} ({span}{', saved before this run' if before_this_run(loss_file) else ''})")
    # TorchTitan's checkpoints: <dump_folder>/<checkpoint.folder>/step-N, complete once .metadata is written.
    checkpoints = [(int(match.group(1)), metadata)
                   for metadata in glob.glob(os.path.join(dump_folder, "*", "step-*", ".metadata"))
                   if (match := re.fullmatch(r"step-(\d+)", os.path.basename(os.path.dirname(metadata))))]
    if checkpoints:
        metadata = max(checkpoints)[1]
        kept.append(f"the last checkpoint {os.path.dirname(metadata)}"
                    + (" (saved before this run)" if before_this_run(metadata) else ""))
    return "kept: " + ", ".join(kept)


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    started = int(time.time())  # whole seconds: some file systems keep modification times no finer
    agent_log = AgentLog()
    logging.getLogger(AGENT_LOGGER).addFilter(agent_log)
    try:
        # torch.distributed.run.main is this plus @record, whose report is the wall this replaces.
        run(args)
    except ChildFailedError as err:
        report, status = failure_report(err, args.log_dir, agent_log.stopped_pids)
        sys.stdout.flush()
        print(report, file=sys.stderr, flush=True)
        return status
    except SignalException as err:  # torchrun's own signal handler: it has stopped every rank
        name = "SIGINT (Ctrl-C)" if err.sigval == signal.SIGINT else err.sigval.name
        sys.stdout.flush()
        print(f"interrupted by {name}: torchrun stopped every rank; {_kept(args.log_dir, started)}",
              file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    finally:
        logging.getLogger(AGENT_LOGGER).removeFilter(agent_log)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
