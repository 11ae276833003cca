"""torchrun with a short failure report; run_train.sh launches training through it.

    python3 -m titan_uniep.torchtitan.torchrun [torchrun arguments] -m titan_uniep.torchtitan.train [training arguments]

The arguments are torchrun's (``torch.distributed.run``), unchanged, and so is
everything until a worker fails. Then torchrun raises ``ChildFailedError``, and
its report is a traceback of the launcher itself and a table (about 40 lines)
after the worker's own message. This prints instead one line per failed rank,
where their logs are, and last the error of the rank that failed first, as the
worker recorded it in its torchelastic error file: TorchTitan's ``@record``
writes the exception there; the trainer writes its start-up errors there with
``exit_with_error``. It exits with that rank's exit code (1 for a signal).

It needs torch only: importing ``titan_uniep`` and ``titan_uniep.torchtitan``
imports no TorchTitan.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import NoReturn

__all__ = ["exit_with_error", "failure_report", "main", "record_errors_whole"]


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


def _exit_status(failure) -> str:
    if failure.exitcode < 0:  # torchrun stops the others with SIGTERM once one has failed
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


def failure_report(err, log_dir: str | None) -> tuple[str, int]:
    """The report of a ``ChildFailedError`` and the exit status to end with.

    One line per failed rank, the first to fail last, then its recorded
    message (or, where it recorded none, where its output is)."""
    first_rank, first = err.get_first_failure()
    message, traced = _recorded(first)
    lines = []
    for rank, failure in sorted(err.failures.items()):
        if rank == first_rank:
            continue
        other, _ = _recorded(failure)
        said = "" if not other else ": the same error" if other == message else f": {other.splitlines()[0]}"
        lines.append(f"rank {rank} failed too ({_exit_status(failure)}){said}")
    if log_dir:
        lines.append(f"every rank's output: {log_dir}")
    head = f"rank {first_rank} failed first ({_exit_status(first)})"
    if message is None:
        lines.append(f"{head}; it recorded no error: its output is above" + (" and in the logs" if log_dir else ""))
    else:
        if traced:
            head += f"; traceback in {first.error_file}"
        lines += [f"{head}:", message]
    return "\n".join(lines), first.exitcode if first.exitcode > 0 else 1


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    try:
        # torch.distributed.run.main is this plus @record, whose report is the wall this replaces.
        run(args)
    except ChildFailedError as err:
        report, status = failure_report(err, args.log_dir)
        sys.stdout.flush()
        print(report, file=sys.stderr, flush=True)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
